"""The Prefect phase-5 artifact shows every format written with its check, and the scores the gate read."""

from __future__ import annotations

import pytest

from memfit.reports import ExportReport

pytestmark = pytest.mark.unit


def test_the_artifact_rows_name_the_adapter_gguf_and_scores_but_not_their_errors():
    from tasks.export import _format_rows

    report = ExportReport(
        final_val_loss=1.0, final_val_perplexity=2.7, safetensors_dir="/x/hf", safetensors_max_abs_diff=0.0,
        onnx_path=None, onnx_max_abs_diff=None, onnx_opset=None, source_checkpoint="s3://b/step-00000010",
        adapter={"dir": "/x/adapter", "base_quantization": "nf4", "max_abs_diff": 1.5e-4, "top1_agree": 1.0},
        gguf={"files": [{"file": "model-f16.gguf", "top1_agree": 1.0, "greedy_equal": 3, "prompts": 3},
                        {"file": "model-q8_0.gguf", "top1_agree": 0.983, "greedy_equal": 2, "prompts": 3}]},
        task_scores={"eval/preference/accuracy": 0.65, "eval/preference/accuracy_stderr": 0.05,
                     "eval/preference/pairs": 80.0, "champion/eval/preference/accuracy": 1.0})
    rows = _format_rows(report)
    assert rows[0] == ("| LoRA adapter | `/x/adapter` (peft on its 4-bit NF4 base (bitsandbytes): max abs diff "
                       "1.50e-04, top-1 100.0%) |")
    assert rows[1] == ("| GGUF (llama.cpp vs transformers) | `model-f16.gguf` top-1 100.0%, greedy 3/3; "
                       "`model-q8_0.gguf` top-1 98.3%, greedy 2/3 |")
    assert rows[2:] == ["| champion/eval/preference/accuracy | 1.0000 |", "| eval/preference/accuracy | 0.6500 |"]
    bare = report.model_copy(update={"adapter": None, "gguf": None, "task_scores": {}})
    assert _format_rows(bare) == []
