#!/usr/bin/env python3
"""Hugging Face MoE checkpoint -> packed ktcy CPU weights (the same code as `ktcy convert`).

    python tools/convert_cpu_weights.py --input path/to/model --output path/to/packed --method AMXINT8
    python tools/convert_cpu_weights.py --input-bf16-hf-path path/to/bf16 --output-fp8-hf-path path/to/fp8

kt-kernel's command lines run unchanged where they can (--input-path, --quant-method int4|int8,
--cpuinfer-threads, --resume-layer); its flags that mean nothing here (--gpu, --threadpool-count,
--no-merge-safetensor, --fp8-expert-batch) are accepted with a note.  Errors are one line on
stderr with exit status 1 (2 for unknown flags); --debug shows the traceback.
"""
import sys

from ktcy.convert import main

if __name__ == "__main__":
    sys.exit(main())
