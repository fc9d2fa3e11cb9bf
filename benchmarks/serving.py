"""Serving benchmark of a running server (OpenAI completions or TGI): TTFT, TPOT, ITL, E2EL, goodput.

A thin wrapper of ``pagedtree.loadgen.serving`` (also ``pagedtree bench serve``):

    python benchmarks/serving.py --backend openai --base-url http://127.0.0.1:8000 \\
        --model qwen2.5-coder-0.5b-instruct --dataset random --input-len 128 --output-len 64 \\
        --num-prompts 50 --request-rate 4 --ignore-eos --save-result benchmarks/out/serving.json

Run ``--help`` for every option.
"""

from __future__ import annotations

import sys

from pagedtree.loadgen.serving import main

if __name__ == "__main__":
    sys.exit(main(prog="benchmarks/serving.py"))
