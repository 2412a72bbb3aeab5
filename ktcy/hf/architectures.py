"""The transformers MoE architectures ktcy.hf serves: which module holds each block's routed
experts, and how checkpoint tensor names map to the model's parameter names."""
import importlib
import re
from dataclasses import dataclass

from ktcy.safetensors_io import CheckpointError

# A routed expert's tensors in a checkpoint: per-expert (experts.3.gate_proj.weight, Mixtral's
# experts.3.w1.weight, their FP8 scales) or fused stacks (experts.gate_up_proj, GPT-OSS's
# experts.gate_up_proj_bias and MXFP4 experts.gate_up_proj_blocks / _scales).  ktcy reads these
# itself; the torch model never holds them.
ROUTED_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+\.|gate_up_proj|down_proj)")


class UnsupportedArchitectureError(ValueError):
    """A checkpoint whose model_type ktcy.hf cannot run."""


@dataclass(frozen=True)
class Architecture:
    model_type: str
    module: str                 # transformers.models.<...>
    experts_class: str          # the @use_experts_implementation class whose forward ktcy replaces
    renames: tuple = ()         # (checkpoint substring, model substring)
    # the transformers config class (in `module`'s package) for a model_type transformers does not
    # register itself: its authors ship it as remote code over an architecture transformers has
    config_class: str = ""
    # checkpoint tensors the causal LM has no place for by design (an image-text release's vision
    # tower, Qwen's multi-token-prediction head)
    unused_prefixes: tuple = ()
    # an image-text model transformers has no causal LM for: built whole (vision tower included)
    # as transformers' image-text-to-text class, its language model's experts on ktcy
    image_text: bool = False

    def model_class(self):
        """The transformers auto class that builds the model from its config."""
        import transformers
        return transformers.AutoModelForImageTextToText if self.image_text else transformers.AutoModelForCausalLM

    def experts_type(self):
        """The transformers class; UnsupportedArchitectureError where the installed transformers
        predates the architecture."""
        return self._transformers_class(self.module, self.experts_class)

    def config_type(self):
        """config_class, or None where transformers' AutoConfig knows the model_type."""
        return self._transformers_class(self.module.rsplit(".", 1)[0], self.config_class) if self.config_class else None

    def _transformers_class(self, module, name):
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            import transformers
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} needs a transformers with {module}.{name} "
                f"(installed: {transformers.__version__}); upgrade transformers") from None

    def model_name(self, checkpoint_name):
        for old, new in self.renames:
            checkpoint_name = checkpoint_name.replace(old, new)
        return checkpoint_name


_TABLE = {a.model_type: a for a in (
    Architecture("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts"),
    # shared expert and its sigmoid gate stay torch modules of the block
    Architecture("qwen2_moe", "transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeExperts"),
    # Qwen3-Next: linear-attention layers, shared expert and its gate stay in torch
    Architecture("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextExperts",
                 unused_prefixes=("mtp.",)),
    # Qwen3.5-MoE: released as an image-text model (model.language_model.*, a vision tower that a
    # causal LM leaves unused); transformers' causal LM is its language model, as here
    Architecture("qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeExperts",
                 renames=(("model.language_model.", "model."),), unused_prefixes=("model.visual.", "mtp.")),
    # Qwen3-VL-MoE and GLM-4.5V: image-text models whole, the vision tower in torch
    Architecture("qwen3_vl_moe", "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeTextExperts",
                 image_text=True),
    Architecture("glm4v_moe", "transformers.models.glm4v_moe.modeling_glm4v_moe", "Glm4vMoeTextExperts",
                 image_text=True),
    Architecture("qwen3_5_moe_text", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeExperts",
                 unused_prefixes=("mtp.",)),
    Architecture("mixtral", "transformers.models.mixtral.modeling_mixtral", "MixtralExperts",
                 renames=((".block_sparse_moe.", ".mlp."),)),
    # MiniMax-M2 stores its experts as Mixtral does; its sigmoid router and bias stay in torch
    Architecture("minimax_m2", "transformers.models.minimax_m2.modeling_minimax_m2", "MiniMaxM2Experts",
                 renames=((".block_sparse_moe.", ".mlp."),)),
    # grouped routers, shared experts and the dense first layers stay in torch
    Architecture("deepseek_v3", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Experts"),
    # Kimi-K2 is DeepSeek-V3's architecture under a model_type of its own (remote code): run as
    # transformers' DeepSeek-V3, experts as released (FP8 block; Kimi-K2-Thinking's INT4)
    Architecture("kimi_k2", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Experts",
                 config_class="DeepseekV3Config"),
    Architecture("deepseek_v2", "transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Experts"),
    Architecture("glm4_moe", "transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeExperts"),
    Architecture("glm4_moe_lite", "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite", "Glm4MoeLiteExperts"),
    Architecture("dots1", "transformers.models.dots1.modeling_dots1", "Dots1Experts"),
    # ERNIE 4.5: its router's bias is stored in moe_statics beside the gate, which transformers
    # moves into the gate module; shared experts stay in torch
    Architecture("ernie4_5_moe", "transformers.models.ernie4_5_moe.modeling_ernie4_5_moe", "Ernie4_5_MoeExperts",
                 renames=((".mlp.moe_statics.", ".mlp.gate.moe_statics."),)),
    Architecture("olmoe", "transformers.models.olmoe.modeling_olmoe", "OlmoeExperts"),
    # router with bias (softmax over the chosen top-k) and attention with sinks and sliding
    # windows stay in torch; the experts' biases and clamped SwiGLU run in ktcy
    Architecture("gpt_oss", "transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts"),
)}

SUPPORTED = tuple(sorted(_TABLE))


def architecture(config_dict, where):
    """The Architecture of a parsed config.json, else UnsupportedArchitectureError listing the
    supported ones."""
    model_type = config_dict.get("model_type") if isinstance(config_dict, dict) else None
    if model_type not in _TABLE:
        names = config_dict.get("architectures") if isinstance(config_dict, dict) else None
        shown = f"{model_type!r:.60}" + (f" ({names[0]!r:.60})" if isinstance(names, list) and names else "")
        raise UnsupportedArchitectureError(f"{where}: model_type {shown} is not supported by ktcy.hf; supported: "
                                           f"{', '.join(SUPPORTED)}")
    return _TABLE[model_type]


def layer_of(module_name):
    """Decoder layer number in a module name such as model.layers.3.mlp.experts."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", module_name)
    if m is None:
        raise CheckpointError(f"{module_name}: no decoder layer number in the module name")
    return int(m.group(1))
