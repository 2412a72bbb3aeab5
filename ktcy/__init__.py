"""ktcy: Mixture-of-Experts expert layers on x86 CPUs (AMX, AVX-512, AVX2) from numpy.

At import the CPU is probed (cpuid/xgetbv, Linux AMX permission) and the best kernel per weight
format is chosen: AMX > AVX-512 > AVX2 > portable C.  CPUINFER_ENABLE_AMX=OFF skips AMX;
KTCY_ISA=amx|amx_emu|avx512|avx2|ref forces one ISA.
"""
try:
    from ktcy import _native  # noqa: F401  (the compiled extension everything below needs)
except ImportError:
    import os as _os
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if _os.path.isfile(_os.path.join(_root, "setup.py")) and _os.path.isfile(_os.path.join(_root, "ktcy", "_native.pyx")):
        # running inside the repository: the source folder shadows the installed package
        raise ImportError(f"ktcy is imported from its source tree ({_root}), where the extension ktcy._native "
                          "is not built, and this hides the installed ktcy: run from another directory "
                          "(cd elsewhere), or build in place with pip install -e .", name="ktcy") from None
    raise

from ktcy import kernels
from ktcy._native import available_isas, build_info, cpu_features, kernel_table
from ktcy.config import MoeConfig, QuantConfig
from ktcy.errors import TileError, UnsupportedISAError
from ktcy.formats import FORMATS
from ktcy.loading import load_experts
from ktcy.log import get_verbosity, set_verbosity
from ktcy.model import MoEModel, RuleError
from ktcy.moe import MoE
from ktcy.safetensors_io import CheckpointError
from ktcy.threads import default_num_threads, get_num_threads, set_num_threads
from ktcy.version import __version__

set_num_threads(default_num_threads())

__all__ = ["CheckpointError", "FORMATS", "MoE", "MoEModel", "RuleError", "MoeConfig", "QuantConfig", "TileError", "UnsupportedISAError",
           "__version__", "available_isas", "build_info", "cpu_features", "get_num_threads", "kernel_table",
           "kernels", "load_experts", "set_num_threads", "set_verbosity", "get_verbosity"]
