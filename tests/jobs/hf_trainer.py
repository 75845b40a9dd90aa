"""A Hugging Face Trainer run on a tiny GPT-2 built from a config in code (random weights, no downloads).

Arguments: the steps, then how often the Trainer logs its loss dict (``logging_steps``, default 1); its default
tqdm bar is drawn on stderr as a user's run draws it."""

from __future__ import annotations

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed pseudo-random token sequences."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    logging_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=4,
                             logging_steps=logging_steps, report_to=[], save_strategy="no", use_cpu=True,
                             ddp_backend="gloo", dataloader_num_workers=0)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=RandomTokens()).train()


if __name__ == "__main__":
    main()
