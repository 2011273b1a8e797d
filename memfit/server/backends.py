"""Generation backends: a SafeTensors export (transformers), an ONNX export (onnxruntime), a GGUF file (llama.cpp)."""

# Both take a batch of token-id prompts and report one new token per sequence per step through `emit`; the engine
# decides when a sequence is done (end of text, its max_tokens, a stop string) and says so via `done`.

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memfit.errors import ModelLoadError

Emit = Callable[[list[int]], None]
Done = Callable[[], list[bool]]
SMOKE_PROMPT = "hello"


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked; requests are batched only with others of the same Sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def pick(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """Pure: next token per row of `logits` (rows, vocab): arg-max, or a draw at temperature within top_p."""
    if sampling.greedy:
        return logits.argmax(-1)
    z = logits.astype(np.float64) / sampling.temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.empty(len(p), dtype=np.int64)
    for i, row in enumerate(p):
        order = np.argsort(-row)
        keep = np.cumsum(row[order]) - row[order] < sampling.top_p  # the smallest prefix holding top_p
        probs = row[order[keep]] / row[order[keep]].sum()
        out[i] = order[keep][rng.choice(len(probs), p=probs)]
    return out


class TransformersBackend:
    """AutoModelForCausalLM from the SafeTensors folder: eval mode, no gradient, KV cache on, left padding."""

    name = "transformers"

    def __init__(self, hf_dir: Path, tokenizer: Any, device: str = "auto"):
        import torch
        from transformers import AutoModelForCausalLM

        from memfit.release.formats import prepare_for_inference
        from memfit.runtime.env import resolve_device

        self.torch = torch
        self.device = resolve_device(device)
        try:
            model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the SafeTensors export {hf_dir}: {str(err).splitlines()[0]}") from None
        self.model = prepare_for_inference(model.to(self.device))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.config = model.config

    def logits(self, ids: np.ndarray) -> np.ndarray:
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.as_tensor(ids, device=self.device), use_cache=False)
        return out.logits.float().cpu().numpy()

    def generate(self, prompts: list[list[int]], max_new: int, sampling: Sampling, emit: Emit, done: Done) -> None:
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every sequence's next token is at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1

        class _Streamer(BaseStreamer):
            first = True

            def put(self, value):  # first the prompts, then one token per sequence per step
                if self.first:
                    self.first = False
                    return
                emit([int(t) for t in value.reshape(-1).tolist()])

            def end(self):
                pass

        class _Stop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.tensor(done(), dtype=torch.bool, device=input_ids.device)

        kwargs: dict[str, Any] = {"do_sample": False} if sampling.greedy else {
            "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        with torch.no_grad():
            self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                max_new_tokens=max_new, use_cache=True, pad_token_id=self.pad_id,
                                streamer=_Streamer(), stopping_criteria=StoppingCriteriaList([_Stop()]), **kwargs)


class OnnxBackend:
    """The ONNX export (input_ids → logits) through onnxruntime on CPU; no KV cache in the graph, so each step
    runs the whole sequence; sequences of equal length share one run."""

    name = "onnx"

    def __init__(self, onnx_path: Path):
        import onnxruntime as ort

        try:
            self.session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        except Exception as err:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise ModelLoadError(f"onnxruntime cannot load {onnx_path}: {str(err).splitlines()[0]}") from None
        self.path = onnx_path

    def logits(self, ids: np.ndarray) -> np.ndarray:
        return self.session.run(["logits"], {"input_ids": ids.astype(np.int64)})[0]

    def generate(self, prompts: list[list[int]], max_new: int, sampling: Sampling, emit: Emit, done: Done) -> None:
        rng = np.random.default_rng(sampling.seed)
        seqs = [list(p) for p in prompts]
        for _ in range(max_new):
            flags = done()
            live = [i for i, d in enumerate(flags) if not d]
            if not live:
                return
            step = [0] * len(seqs)
            by_len: dict[int, list[int]] = {}
            for i in live:
                by_len.setdefault(len(seqs[i]), []).append(i)
            for rows in by_len.values():
                last = self.logits(np.array([seqs[i] for i in rows]))[:, -1, :]
                for i, tok in zip(rows, pick(last, sampling, rng).tolist(), strict=True):
                    step[i] = int(tok)
            for i in live:
                seqs[i].append(step[i])
            emit(step)


class LlamaCppBackend:
    """A GGUF file through llama.cpp (llama-cpp-python), with its KV cache. One llama.cpp context holds one sequence:
    a batch's sequences take turns, each one's state (its KV cache) saved and restored between its tokens."""

    name = "llama.cpp"

    def __init__(self, gguf_path: Path, context: int):
        import os

        from memfit.release.llama_loader import open_gguf

        try:
            self.llm = open_gguf(str(gguf_path), n_ctx=context, logits_all=True, verbose=False, seed=0,
                             n_threads=os.cpu_count() or 1)
        except (ValueError, RuntimeError) as err:
            raise ModelLoadError(f"llama.cpp cannot load {gguf_path}: {str(err).splitlines()[0]}") from None
        self.path = gguf_path

    def logits(self, ids: np.ndarray) -> np.ndarray:
        # Also called between generate's steps (a stream's logprobs), with the sequence being generated so far: the
        # context then holds that same sequence and the next step goes on from it; a batch's sequences load their
        # own state before each step anyway.
        rows = []
        for row in ids.tolist():
            self.llm.reset()
            self.llm.eval(row)
            rows.append(np.array(self.llm.scores[: len(row)], dtype=np.float32))
        return np.stack(rows)

    def _last(self) -> np.ndarray:
        return np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32)

    def generate(self, prompts: list[list[int]], max_new: int, sampling: Sampling, emit: Emit, done: Done) -> None:
        rng = np.random.default_rng(sampling.seed)
        alone = len(prompts) == 1  # no state to swap
        states, last = [], []
        for prompt in prompts:
            self.llm.reset()
            self.llm.eval(prompt)
            last.append(self._last())
            states.append(None if alone else self.llm.save_state())
        for _ in range(max_new):
            live = [i for i, d in enumerate(done()) if not d]
            if not live:
                return
            step = [0] * len(prompts)
            for i in live:
                if not alone:
                    self.llm.load_state(states[i])
                step[i] = int(pick(last[i][None], sampling, rng)[0])
                self.llm.eval([step[i]])
                last[i] = self._last()
                if not alone:
                    states[i] = self.llm.save_state()
            emit(step)


def onnx_criteria(onnx_path: Path) -> Any:
    """The parity limits recorded beside the ONNX file at export (its `.memfit.json`), or None."""
    from memfit.release.formats import ONNX_METADATA_SUFFIX
    from memfit.release.parity import ParityCriteria

    meta = onnx_path.with_name(onnx_path.name + ONNX_METADATA_SUFFIX)
    try:
        doc = json.loads(meta.read_text())
        return ParityCriteria(**doc["parity_criteria"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
