"""MoE layer configuration in the seeds' vocabulary: QuantConfig and MoeConfig."""
import math
import numbers
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ktcy._native import INT8_MAX_K, ISAS
from ktcy.formats import AMX_BACKENDS, DEFAULT_INT4_GROUP, canonical_format, group_sizes, has_groups


@dataclass(frozen=True)
class QuantConfig:
    """How expert weights are stored: method BF16 | INT8 | INT8_GROUP | INT8_MIN | INT4 | INT4_ZP | INT4_MIN | FP8 |
    MXFP4 | MXFP4_A8 (KTransformers names work too); per_channel picks FP8 per-channel scales (else
    128x128 blocks); group_size is the grouped formats' (INT4 family 32/64/128, INT8_GROUP and INT8_MIN also 16;
    other formats ignore it)."""
    method: str = "BF16"
    per_channel: Optional[bool] = None
    group_size: int = DEFAULT_INT4_GROUP

    def __post_init__(self):
        if self.per_channel is not None and not isinstance(self.per_channel, (bool, np.bool_)):
            raise TypeError(f"QuantConfig.per_channel must be True, False or None, got {self.per_channel!r}")
        canonical_format(self.method, self.per_channel)  # validates the name
        fmt = canonical_format(self.method)
        if has_groups(fmt):
            if not _is_integer(self.group_size) or self.group_size not in group_sizes(fmt):
                raise ValueError(f"{fmt} group_size must be one of {group_sizes(fmt)}, got {self.group_size!r}")
            object.__setattr__(self, "group_size", int(self.group_size))


def checked_isa(isa: Optional[str]) -> Optional[str]:
    """An isa= argument in lower case (None: the dispatcher chooses), refused before any work is
    done: a misspelt name is the caller's error, not a fault of the checkpoint being loaded."""
    if isa is None:
        return None
    if not isinstance(isa, str):
        raise TypeError(f"isa must be a string or None, got {type(isa).__name__}")
    name = isa.strip().lower()
    if name not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}; choose one of {', '.join(ISAS)}")
    return name


def _is_integer(value):
    """An int or numpy integer, not a bool (True == 1) and not a float that equals a whole number."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class MoeConfig:
    """Shape and precision of one MoE layer's experts.

    backend (optional) overrides quant_config.method with a KTransformers backend name; an AMX
    backend on a CPU without usable AMX falls back to the best ISA for its format.  isa forces one
    ISA and fails if it can't run.  num_threads: threads of this layer's forward (default: ktcy's
    count at call time, ktcy.set_num_threads); it does not change the process-wide count.
    activation: "silu" (down(silu(gate x) * up x)) or "gpt_oss" (GPT-OSS's clamped form:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)); swiglu_alpha
    and swiglu_limit are its alpha and limit.  down_quant_config (optional): the down projection's
    own format and group (a GGUF Q4_K_M layer keeps Q4_K gate and up as INT4_MIN and its Q6_K
    down as INT8_GROUP); None: quant_config's (or the backend's) for all three."""
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    backend: Optional[str] = None
    isa: Optional[str] = None
    num_threads: Optional[int] = None
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    down_quant_config: Optional[QuantConfig] = None

    def __post_init__(self):
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "num_threads"):
            value = getattr(self, name)
            if name == "num_threads" and value is None:
                continue
            if not _is_integer(value) or value < 1:
                raise ValueError(f"MoeConfig.{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy integers as plain ints
        object.__setattr__(self, "isa", checked_isa(self.isa))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.activation not in ("silu", "gpt_oss"):
            raise ValueError(f"MoeConfig.activation must be 'silu' or 'gpt_oss', got {self.activation!r}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"MoeConfig.{name} must be a positive finite number, got {value!r}")
            object.__setattr__(self, name, float(value))  # numpy floats as plain floats
        if not isinstance(self.quant_config, QuantConfig):
            raise TypeError("quant_config must be a ktcy.QuantConfig")
        if self.down_quant_config is not None and not isinstance(self.down_quant_config, QuantConfig):
            raise TypeError("down_quant_config must be a ktcy.QuantConfig or None")
        for fmt, k, what in ((self.weight_format, self.hidden_size, "gate/up"),
                             (self.down_format, self.intermediate_size, "down")):
            if fmt == "INT8" and k > INT8_MAX_K:
                raise ValueError(f"INT8 {what} experts with K = {k} (hidden_size {self.hidden_size}, intermediate_size "
                                 f"{self.intermediate_size}): K > {INT8_MAX_K} would overflow the int32 sums; "
                                 "use BF16, INT8_GROUP or INT4")

    @property
    def weight_format(self):
        if self.backend is not None:
            return canonical_format(self.backend, self.quant_config.per_channel)
        return canonical_format(self.quant_config.method, self.quant_config.per_channel)

    @property
    def down_format(self):
        """The down projection's format: down_quant_config's, else weight_format."""
        if self.down_quant_config is None:
            return self.weight_format
        return canonical_format(self.down_quant_config.method, self.down_quant_config.per_channel)

    @property
    def down_group_size(self):
        return (self.down_quant_config or self.quant_config).group_size

    @property
    def wants_amx(self):
        """True when the backend name itself asks for AMX (AMXINT8, AMXBF16, ...)."""
        return self.backend is not None and self.backend.strip().upper() in AMX_BACKENDS
