"""ktcy: Mixture-of-Experts expert layers on x86 CPUs (AMX, AVX-512, AVX2) from numpy.

At import the CPU is probed (cpuid/xgetbv, Linux AMX permission) and the best kernel per weight
format is chosen: AMX > AVX-512 > AVX2 > portable C.  CPUINFER_ENABLE_AMX=OFF skips AMX;
KTCY_ISA=amx|amx_emu|avx512|avx2|ref forces one ISA.
"""
from ktcy import kernels
from ktcy._native import available_isas, build_info, cpu_features, kernel_table
from ktcy.config import MoeConfig, QuantConfig
from ktcy.errors import TileError, UnsupportedISAError
from ktcy.formats import FORMATS
from ktcy.loading import load_experts
from ktcy.model import MoEModel, RuleError
from ktcy.moe import MoE
from ktcy.safetensors_io import CheckpointError
from ktcy.threads import default_num_threads, get_num_threads, set_num_threads
from ktcy.version import __version__

set_num_threads(default_num_threads())

__all__ = ["CheckpointError", "FORMATS", "MoE", "MoEModel", "RuleError", "MoeConfig", "QuantConfig", "TileError", "UnsupportedISAError",
           "__version__", "available_isas", "build_info", "cpu_features", "get_num_threads", "kernel_table",
           "kernels", "load_experts", "set_num_threads"]
