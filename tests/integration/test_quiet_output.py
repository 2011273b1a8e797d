"""A run's terminal holds memfit's lines, not third-party warnings: MLflow's pyfunc advice, bitsandbytes' hub kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _tiny_export(folder: Path) -> Path:
    """A tiny Llama and its tokenizer saved as an export's hf/ folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.models.loading import train_tokenizer

    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=64)).save_pretrained(folder)
    train_tokenizer(["one two three four five six seven"] * 20, 300, folder)
    return folder


def _type_hint_advice(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "Add type hints to the `predict` method" in str(w.message)]


def test_logging_and_loading_the_pyfunc_model_warns_nothing(tmp_path, mlflow_uri):
    import mlflow
    import pandas as pd
    from mlflow.pyfunc import PythonModel
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    from memfit.release.registry import log_model
    from memfit.tracking.sqlite_seed import open_client

    client = open_client(mlflow_uri)
    run = client.create_run(client.create_experiment("quiet"))
    export = _tiny_export(tmp_path / "hf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.onceregistry.clear()  # MLflow shows its advice "once" a process: an earlier test may have used it
        model_uri, _ = log_model(client, mlflow_uri, run.info.run_id, export)
        with _use_tracking_uri(mlflow_uri):
            model = mlflow.pyfunc.load_model(model_uri)  # runs pyfunc.py again, as every load does
        answers = model.predict(pd.DataFrame({"prompt": ["one two", "three"]}), params={"max_new_tokens": 2})
    assert _type_hint_advice(caught) == []
    # The hints change nothing else: the explicit signature is the logged one, and a DataFrame still answers.
    assert [c.name for c in model.metadata.get_input_schema().inputs] == ["prompt", "messages"]
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)

    # The same check sees the advice where it is due: a predict() without hints.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.onceregistry.clear()

        class Untyped(PythonModel):
            def predict(self, context, model_input, params=None):
                return model_input

    assert len(_type_hint_advice(caught)) == 1


# The scripts below collect every warning logged in their process.
KEEP_WARNINGS = r"""
import logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(f"{record.name}: {record.getMessage()}")
logging.getLogger().addHandler(Keep(level=logging.WARNING))
"""

# In a process of its own: whether bitsandbytes is imported is a fact about the whole process.
LORA_THEN_NF4 = KEEP_WARNINGS + r"""
import json, sys, warnings
from types import SimpleNamespace
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from memfit.models.lora import merge_lora, prepare_lora_model

def tiny():
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))

out = {}
lora = SimpleNamespace(target_modules="attention", r=4, alpha=8, dropout=0.0, quantize="none")
with warnings.catch_warnings(record=True) as caught:  # the default filters: what a user's terminal shows
    merge_lora(prepare_lora_model(tiny(), lora, "fp32"))
out["lora"] = {"bitsandbytes": "bitsandbytes" in sys.modules, "warnings": [str(w.message) for w in caught],
               "logs": list(records)}
if sys.argv[1] == "nf4":
    lora.quantize = "nf4"
    with warnings.catch_warnings(record=True) as caught:
        prepare_lora_model(tiny(), lora, "bf16-mixed")
    out["nf4"] = {"bitsandbytes": "bitsandbytes" in sys.modules, "logs": records[len(out["lora"]["logs"]):]}
print("RESULT " + json.dumps(out))
"""


def test_a_lora_model_imports_no_bitsandbytes_and_nf4_logs_no_hub_kernel_notice():
    import importlib.util

    nf4 = importlib.util.find_spec("bitsandbytes") is not None
    proc = subprocess.run([sys.executable, "-c", LORA_THEN_NF4, "nf4" if nf4 else "lora"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0].split(" ", 1)[1])
    # No quantization: peft builds the adapters without importing bitsandbytes (seconds, and its notice).
    assert out["lora"] == {"bitsandbytes": False, "warnings": [], "logs": []}, out["lora"]
    if nf4:  # NF4 needs bitsandbytes: imported, and its notice about an optional hub kernel dropped at the import
        assert out["nf4"]["bitsandbytes"] is True
        assert not [r for r in out["nf4"]["logs"] if "gemm_4bit_forward" in r], out["nf4"]["logs"]


ADAMW_8BIT = KEEP_WARNINGS + r"""
import torch
from memfit.memory.techniques.optim import make_adamw
optimizer = make_adamw(torch.nn.Linear(8, 8), 1e-3, 0.0, kind="adamw-8bit")
print("RESULT", type(optimizer).__name__, records)
"""


def test_the_8bit_optimizer_logs_no_hub_kernel_notice():
    pytest.importorskip("bitsandbytes")
    proc = subprocess.run([sys.executable, "-c", ADAMW_8BIT], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT AdamW8bit" in proc.stdout and "gemm_4bit_forward" not in proc.stdout + proc.stderr, proc.stdout
