"""A transformers Trainer run recorded with one line: a tiny BERT on synthetic tokens.

The model is built from a BertConfig (2 layers, hidden size 32): nothing is
downloaded. The task: is token 7 more frequent than token 9 in the sequence?
Seconds per epoch on a CPU.

    python examples/hf_trainer.py --epochs 4 --lr 3e-4
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from retrolog.integrations.transformers import RetrologCallback

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-4)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--seed", type=int, default=0)
opts = parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, 40, (n, 24), generator=g)
        self.labels = ((self.ids == 7).sum(1) > (self.ids == 9).sum(1)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[i]}


class Report(TrainerCallback):
    """The script's own hooks: one per step (gradients present) and one per epoch."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        pass

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        pass


def compute_metrics(prediction):
    logits, labels = prediction
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


config = BertConfig(
    vocab_size=48,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
    num_labels=2,
)
torch.manual_seed(opts.seed)
model = BertForSequenceClassification(config)
args = TrainingArguments(
    output_dir="hf_out",
    num_train_epochs=opts.epochs,
    learning_rate=opts.lr,
    per_device_train_batch_size=opts.batch_size,
    per_device_eval_batch_size=64,
    eval_strategy="epoch",
    save_strategy="no",
    logging_steps=5,
    report_to="none",
    disable_tqdm=True,
    use_cpu=True,
    seed=opts.seed,
)
trainer = Trainer(
    model=model,
    args=args,
    train_dataset=Tokens(opts.samples, opts.seed),
    eval_dataset=Tokens(128, opts.seed + 1),
    compute_metrics=compute_metrics,
    callbacks=[Report(), RetrologCallback()],
)
trainer.train()
