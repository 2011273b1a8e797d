"""An MLflow pyfunc over a memfit SafeTensors export: prompts in, greedy completions out (no memfit import).

MLflow copies this file into the logged model and executes it on load (models from code), so the
model never depends on a pickle and loads anywhere torch + transformers are installed.
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel


class CausalLMModel(PythonModel):
    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = context.artifacts["hf"]
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()

    # No type hints here: MLflow would derive a (wrong) signature from them; the logged one is explicit.
    def predict(self, context, model_input, params=None):
        import torch

        if hasattr(model_input, "columns"):  # a DataFrame with a `prompt` column (the signature's input)
            prompts = [str(p) for p in model_input["prompt"]]
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = [str(p) for p in model_input]
        max_new = int((params or {}).get("max_new_tokens", 32))
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = []
        with torch.no_grad():
            for prompt in prompts:
                ids = tok(prompt, return_tensors="pt")["input_ids"]
                gen = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                          do_sample=False, use_cache=True, pad_token_id=pad)
                out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
        return out


mlflow.models.set_model(CausalLMModel())
