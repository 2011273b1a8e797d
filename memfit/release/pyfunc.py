"""An MLflow pyfunc over a memfit SafeTensors export: prompts or chat messages in, greedy answers (no memfit import)."""

# MLflow copies this file into the logged model and executes it on load (models from code), so the model never depends
# on a pickle and loads anywhere torch + transformers are installed.

from __future__ import annotations

from typing import Any

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel


class CausalLMModel(PythonModel):
    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = context.artifacts["hf"]
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()

    # MLflow hands a logged model's input over as a DataFrame (the explicit signature's columns). A DataFrame hint
    # is the one MLflow takes without deriving a signature from it (the logged one stays), and without it MLflow
    # warns "Add type hints to the `predict` method" each time this class is defined: on logging and every load.
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        import torch

        prompts = [self._prompt(item) for item in _items(model_input)]
        max_new = int((params or {}).get("max_new_tokens", 32))
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = []
        with torch.no_grad():
            for prompt, special in prompts:
                ids = tok(prompt, return_tensors="pt", add_special_tokens=special)["input_ids"]
                gen = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                          do_sample=False, use_cache=True, pad_token_id=pad)
                out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
        return out

    def _prompt(self, item):
        """(text to continue, add special tokens?): a conversation is rendered with the exported chat template."""
        if isinstance(item, str):
            return item, True
        turns = [{"role": str(t["role"]), "content": str(t["content"])} for t in item]
        return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True), False


def _is_missing(value):
    return value is None or (isinstance(value, float) and value != value)  # NaN: pandas' empty cell


def _items(model_input):
    """Prompts (str) and conversations (lists of {role, content}) from a DataFrame with `prompt` / `messages`
    columns, a dict, one string, one conversation, or a list of either."""
    if hasattr(model_input, "columns"):
        rows = model_input.to_dict("records")
        return [r["messages"] if not _is_missing(r.get("messages")) else str(r["prompt"]) for r in rows]
    if isinstance(model_input, dict):
        return [model_input["messages"]] if "messages" in model_input else [str(model_input["prompt"])]
    if isinstance(model_input, str):
        return [model_input]
    items = list(model_input)
    if items and isinstance(items[0], dict):  # one conversation
        return [items]
    return [p if isinstance(p, (list, tuple)) else str(p) for p in items]


mlflow.models.set_model(CausalLMModel())
