"""One rank of the concurrent model-cache test: start torch.distributed (gloo), then materialise a
built-in model into the (shared, initially empty) cache and print its directory."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as torch_dist

from dschat.models.builtin import materialize

torch_dist.init_process_group("gloo")
torch_dist.barrier()  # both ranks start building at the same moment
print(materialize(sys.argv[1]))
torch_dist.barrier()
torch_dist.destroy_process_group()
