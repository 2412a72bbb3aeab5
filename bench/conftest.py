"""Session fixtures of the benchmark suite: the roofline is measured once."""
import numpy as np
import pytest

from ktcy.roofline import roofline


@pytest.fixture(scope="session")
def roof():
    return roofline()


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)
