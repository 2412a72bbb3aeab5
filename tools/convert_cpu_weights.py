#!/usr/bin/env python3
"""Hugging Face MoE checkpoint -> packed ktcy CPU weights (the same code as `ktcy convert`).

    python tools/convert_cpu_weights.py --input path/to/model --output path/to/packed --method AMXINT8
    python tools/convert_cpu_weights.py --input-bf16-hf-path path/to/bf16 --output-fp8-hf-path path/to/fp8
"""
import sys

from ktcy.convert import main

if __name__ == "__main__":
    sys.exit(main())
