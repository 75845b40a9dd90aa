"""A Lightning Trainer run (DDP on CPU) of a small regression model, with Lightning's default progress bar."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch


class Regressor(L.LightningModule):
    """Two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(100_000, 128), torch.randn(100_000, 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // per_node
    trainer = L.Trainer(accelerator="cpu", devices=per_node, num_nodes=nodes, strategy="ddp", max_steps=steps,
                        logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=64))
    # As PyTorch's DDP examples end: a worker that exits with its gloo group alive may abort in teardown
    # ("terminate called without an active exception"), and its peer's launcher then waits in torchrun's exit
    # barrier for minutes.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
