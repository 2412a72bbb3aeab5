"""The optional dependencies of ktcy.hf, imported on demand so the numpy core never needs them."""

INSTALL_HINT = "pip install ktcy[hf]"


def require_torch_transformers():
    """(torch, transformers), or ImportError saying how to install them."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ImportError(f"ktcy.hf needs torch and transformers ({e}); install them with `{INSTALL_HINT}` "
                          "(the CPU build of torch is enough)", name=getattr(e, "name", None)) from None
    return torch, transformers
