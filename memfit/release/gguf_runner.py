"""Runs one of llama.cpp's converter scripts with its own gguf-py, and memfit's fallbacks around it (never in it)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

# Each fallback below wraps a converter function and only acts where the converter itself gives up (an exception,
# a missing key, a score it cannot know): a folder the converter handles is converted exactly as llama.cpp would.
# The export's verification (token ids, greedy tokens, top-1 agreement in llama.cpp) judges the result either way.


def _pre_tokenizer_fallback(base, pre: str | None) -> None:
    """convert_hf_to_gguf.py names a BPE pre-tokenizer by hashing a sample's tokens against the hub tokenizers it
    lists; a tokenizer trained by the team (or newer than the converter) is in no list and the converter stops.
    memfit names it from the pre-tokenizer of the tokenizer as transformers loads it (memfit.release.gguf):
    not the file's, since transformers 5 gives some families their own (Qwen2Tokenizer splits digits singly, a
    tokenizer.json saying GPT-2's split or not); `pre` (the export's name for the file) when that is none known."""
    import json

    from memfit.release.gguf import pre_tokenizer

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            name = (pre_tokenizer(json.loads(backend.to_str())) if backend is not None else None) or pre
            if name is None:
                raise
            base.logger.warning("memfit: pre-tokenizer not in llama.cpp's hash table; using %r from the tokenizer",
                                name)
            return name

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre


def _vocab_fallback(conversion, base) -> None:
    """Some families' set_vocab reads only SentencePiece's tokenizer.model (Gemma 2, Phi-3 unless its
    tokenizer_config names GPT2Tokenizer), as their released models ship one; a model fine-tuned with a tokenizer
    of its own has only tokenizer.json. Where set_vocab fails for want of tokenizer.model, the vocabulary is
    written as the converter writes any tokenizer.json: byte-level BPE as "gpt2", byte-fallback BPE as "llama"."""
    from memfit.release.gguf import byte_fallback, tokenizer_doc

    lookup = conversion.get_model_class

    def get_model_class(*args, **kwargs):
        model_class = lookup(*args, **kwargs)
        own = model_class.set_vocab
        if getattr(own, "_memfit", False):
            return model_class

        def set_vocab(self):
            try:
                return own(self)
            except (FileNotFoundError, ValueError):
                doc = tokenizer_doc(self.dir_model)
                if (self.dir_model / "tokenizer.model").is_file() or doc is None:
                    raise
            base.logger.warning("memfit: no tokenizer.model; writing the vocabulary from tokenizer.json")
            return self._set_vocab_llama_hf() if byte_fallback(doc) else self._set_vocab_gpt2()

        set_vocab._memfit = True
        model_class.set_vocab = set_vocab
        _layer_types_fallback(base, model_class)
        return model_class

    conversion.get_model_class = get_model_class


def _layer_types_fallback(base, model_class) -> None:
    """Gemma 3's converter writes no sliding-window pattern, and llama.cpp then assumes the released models' (five
    sliding layers, then one full); a model whose layer_types say otherwise would get the wrong layers' rope base
    and window (measured on a 2-layer model: f16 max KL 3e-4 where every other family gives 1e-8). memfit writes
    layer_types as the per-layer pattern, which llama.cpp reads first (load_swa_pattern)."""
    import gguf

    own = model_class.set_gguf_parameters
    if getattr(model_class, "model_arch", None) != gguf.MODEL_ARCH.GEMMA3 or getattr(own, "_memfit", False):
        return

    def set_gguf_parameters(self):
        own(self)
        types = self.hparams.get("layer_types")
        if types and self.hparams.get("sliding_window"):
            self.gguf_writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])

    set_gguf_parameters._memfit = True
    model_class.set_gguf_parameters = set_gguf_parameters


def _scores_fallback(gguf) -> None:
    """gguf's LlamaHfVocab (a SentencePiece-style tokenizer.json, no tokenizer.model) scores every token -1000, and
    llama.cpp's SentencePiece tokenizer merges by score: memfit scores each token by its merge's rank instead."""
    from memfit.release.gguf import merge_scores, tokenizer_doc

    hf_tokens = gguf.LlamaHfVocab.hf_tokens

    def scored(self):
        rows = list(hf_tokens(self))
        doc = tokenizer_doc(self.fname_tokenizer.parent)
        if not rows or doc is None:
            yield from rows
            return
        texts, scores, types = (list(x) for x in zip(*rows, strict=True))
        yield from zip(texts, merge_scores(doc, texts, scores), types, strict=True)

    gguf.LlamaHfVocab.hf_tokens = scored


def _special_fallback(gguf) -> None:
    """Two things gguf's SpecialVocab writes from tokenizer files, where they hold too little for llama.cpp:
    - transformers' {% generation %} tags (memfit's training templates mark trained tokens with them) are unknown
      to llama.cpp's Jinja; the template is written without them (they change nothing in the rendering);
    - whether <bos>/<eos> are added: read from add_bos_token or a TemplateProcessing post-processor, else left to
      llama.cpp's default per pre-tokenizer (llama-bpe adds <bos>); a tokenizer saved by transformers 5 without
      either is asked what it adds, as the export's token-id check does."""
    from memfit.release.gguf import chat_template_for_gguf

    load, add = gguf.SpecialVocab._load, gguf.SpecialVocab.add_to_gguf

    def _load(self, path):
        self._memfit_path = path
        return load(self, path)

    def add_to_gguf(self, gw, *args, **kwargs):
        self.chat_template = chat_template_for_gguf(self.chat_template)
        if "bos" not in self.add_special_token or "eos" not in self.add_special_token:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self._memfit_path)
            with_special, plain = tok("x")["input_ids"], tok("x", add_special_tokens=False)["input_ids"]
            added = len(with_special) > len(plain)
            self.add_special_token.setdefault("bos", added and with_special[0] == tok.bos_token_id)
            self.add_special_token.setdefault("eos", added and with_special[-1] == tok.eos_token_id)
        return add(self, gw, *args, **kwargs)

    gguf.SpecialVocab._load, gguf.SpecialVocab.add_to_gguf = _load, add_to_gguf


def _hparams_fallback(base) -> None:
    """transformers 5 no longer writes GPT-2's n_ctx (always n_positions) to config.json; the converter reads it."""
    load = base.ModelBase.load_hparams

    def load_hparams(dir_model, *args, **kwargs):
        hparams = load(dir_model, *args, **kwargs)
        if hparams.get("model_type") == "gpt2" and "n_ctx" not in hparams and "n_positions" in hparams:
            hparams["n_ctx"] = hparams["n_positions"]
        return hparams

    base.ModelBase.load_hparams = staticmethod(load_hparams)


def main(argv: list[str]) -> None:
    folder, script, *args = argv
    root = Path(folder).resolve()
    # The converter's own gguf-py first (it matches the converter; the installed gguf may not), then its folder.
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    import conversion
    import gguf
    from conversion import base

    _pre_tokenizer_fallback(base, os.environ.get("MEMFIT_GGUF_PRE") or None)
    _vocab_fallback(conversion, base)
    _scores_fallback(gguf)
    _special_fallback(gguf)
    _hparams_fallback(base)
    sys.argv = [str(root / script), *args]
    runpy.run_path(str(root / script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
