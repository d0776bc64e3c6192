"""Convert the tiny model directory to GGUF for llama.cpp's ``llama-server``, with
llama.cpp's own converter (``convert_hf_to_gguf.py``, kept beside the built server).

Run by the vLLM environment's Python (the converter needs torch):
``python to_gguf.py LLAMA_CPP_SOURCE MODEL_DIR OUT.gguf``.

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a test string,
and refuses ours, which it has never seen. Ours is the byte-level (GPT-2) regex, so the
converter is told that one (``gpt-2``, llama.cpp's name); token ids then match the Hugging
Face tokenizer's (the tests check it on their prompts).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    source, model_dir, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    from conversion.base import TextModel  # the vendored converter's own package

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", "f32"]
    runpy.run_path(str(source / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
