"""Runs one of llama.cpp's converter scripts with its own gguf-py, and memfit's pre-tokenizer name as a fallback."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path


def _with_fallback(pre: str):
    """convert_hf_to_gguf.py names a BPE pre-tokenizer by hashing a sample's tokens against the hub tokenizers it
    lists; a tokenizer trained by the team (or newer than the converter) is in no list and the converter stops.
    memfit names it from tokenizer.json's own pre-tokenizer instead (memfit.release.gguf_vocab), and the export's
    verification compares llama.cpp's token ids with the tokenizer's, so a wrong name cannot pass unnoticed."""
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            base.logger.warning("memfit: pre-tokenizer not in llama.cpp's hash table; using %r from tokenizer.json",
                                pre)
            return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str]) -> None:
    folder, script, *args = argv
    root = Path(folder).resolve()
    # The converter's own gguf-py first (it matches the converter; the installed gguf may not), then its folder.
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    if pre := os.environ.get("MEMFIT_GGUF_PRE"):
        _with_fallback(pre)
    sys.argv = [str(root / script), *args]
    runpy.run_path(str(root / script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
