"""The data section: where records come from, their format, templates, masks and packing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from memfit.config.release import Section as _Section


class DataConfig(_Section):
    path: str | None = Field(
        None, description="A .txt/.jsonl/.json/.parquet/.csv file, a folder of them, a folder written by datasets' "
        "save_to_disk, or hf:NAME[@REVISION] for a dataset loaded with datasets.load_dataset (the revision pins a "
        "commit, tag or branch). Unset: a seeded synthetic corpus.")
    format: Literal["auto", "text", "prompt_completion", "messages", "preference"] = Field(
        "auto", description="Record layout. auto: preference when records have chosen_field and rejected_field, "
        "messages when they have messages_field, prompt_completion when they have prompt_field and "
        "completion_field, else text (the log says which and why). preference (train.objective dpo): TRL's "
        "pairs, prompt/chosen/rejected strings or message lists, or whole chosen/rejected conversations sharing "
        "their prompt; one pair a row, padded per batch, loss on the completions only (data.packing and "
        "data.train_on do not apply). Unset data.path: seeded synthetic pairs.")
    text_field: str = Field("text", description="Field holding the text in text-format records.")
    prompt_field: str = Field("prompt", description="Field holding the prompt in prompt_completion records.")
    completion_field: str = Field("completion", description="Field holding the answer in prompt_completion records.")
    messages_field: str = Field(
        "messages", description="Field holding the conversation (a list of {role, content}) in messages records.")
    chosen_field: str = Field("chosen", description="Field holding the preferred completion in preference records.")
    rejected_field: str = Field(
        "rejected", description="Field holding the dispreferred completion in preference records.")
    split: str = Field("train", description="Split to read from a hub dataset or a saved DatasetDict.")
    chat_template: str | None = Field(
        None, description="A Jinja chat template file for messages data (replaces the tokenizer's own and travels "
        "with the export), or a built-in name: chatml, llama-3. Unset: the tokenizer's (presets have one).")
    train_on: Literal["all", "completion", "assistant"] = Field(
        "all", description="Tokens the loss trains on: all; completion (the completion of prompt_completion "
        "records, the last assistant turn of messages); assistant (every assistant turn, from the template's "
        "generation markers, or rendered turn by turn when it has none). Labels are -100 elsewhere.")
    packing: Literal["blocks", "padding_free", "none", "auto"] = Field(
        "blocks", description="blocks: all examples concatenated and cut into seq_len blocks (attention crosses "
        "examples); padding_free: whole examples packed up to seq_len tokens a row, position_ids restarting and "
        "no attention across examples; none: one example a row, padded per batch with an attention mask; auto: "
        "the one predicted fastest per trained token on the target device (memory.device, else this machine) from "
        "the data's lengths, the model's shape and its attention kernel (blocks only for plain text trained on "
        "all tokens). The choice and the alternatives are logged and shown by memfit plan.")
    flatten: bool | Literal["auto"] = Field(
        "auto", description="padding_free: join each micro-batch's rows into one sequence without their tail "
        "padding, so no padding is computed (position_ids keep the examples apart). auto: true where attention "
        "reads the boundaries from position_ids (flash attention, CUDA), false elsewhere: on SDPA/eager a "
        "block-diagonal mask over the joined sequence costs micro-batch x the attention of per-row masks.")
    group_by_length: bool = Field(
        True, description="packing none: each micro-batch drawn from examples of similar length (a shuffled "
        "window of 50 micro-batches sorted by length, as the HF Trainer's group_by_length), so little padding is "
        "computed; false: a plain shuffle.")
    overlong: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="padding_free/none: what happens to an example longer than seq_len (counts "
        "are logged).")
    heldout_prompts: int = Field(
        4, ge=0, le=64, description="prompt_completion/messages with padding_free/none: held-out validation "
        "examples whose prompts phase 5 answers (template applied), logged beside their reference answers.")
    seq_len: int = Field(128, ge=8, le=131072, description="Tokens per packed training block (row).")
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5, description="Share of blocks held out for validation.")
    synthetic_docs: int = Field(2000, ge=10, le=10_000_000, description="Synthetic corpus size (documents).")
    seed: int = Field(1234, description="Seed of the synthetic corpus and the train/validation split.")
    num_proc: int | None = Field(
        None, ge=1, le=512, description="Processes that read, check and tokenise the records in parallel when "
        "the data is first checked and its rows prepared (once per data version; every phase reuses them). Unset: "
        "the cores this process may use; a small corpus takes fewer (one slice of 2048 records: none).")
    streaming: bool = Field(
        False, description="Read the records as a stream (datasets' IterableDataset over the files, or "
        "load_dataset(NAME, streaming=True) for hf:NAME) and cut blocks on the fly, with no packed rows on disk: "
        "for a corpus larger than the data cache should hold. Plain text blocks only (packing blocks, train_on all; "
        ".txt, or a text field in .jsonl/.json/.parquet/.csv, a saved dataset or hf:NAME). The first "
        "train.eval_batches micro-batches of blocks are the validation set; the stream position is saved in "
        "training checkpoints, so a resume continues at the exact block.")
    shuffle_buffer: int = Field(
        1024, ge=1, le=1_000_000, description="data.streaming: blocks shuffled together. A stream cannot be shuffled "
        "globally: each window of this many consecutive blocks is permuted (seeded by train.seed, the epoch and the "
        "window), so a block moves at most this far; larger mixes more and holds more blocks in memory.")

    @model_validator(mode="after")
    def _streaming_blocks(self) -> DataConfig:
        # Other layouts need every example's length (padding_free, auto) or a record read whole (answer masks).
        if not self.streaming:
            return self
        wrong = [f"data.{k}: {want} (got {got})" for k, want, got in (
            ("packing", "blocks", self.packing), ("train_on", "all", self.train_on),
            ("path", "files, a saved dataset or hf:NAME", self.path)) if (got != want if k != "path" else not got)]
        if wrong:
            raise ValueError("data.streaming: true streams plain text blocks from data.path only; set "
                             f"{', '.join(wrong)}, or data.streaming: false")
        return self
