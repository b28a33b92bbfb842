"""Rank 0 calls a barrier rank 1 never reaches (rank 1 is busy elsewhere): a hang."""

import time

import torch

import phalanx

phalanx.init_process_group(backend="gloo")
phalanx.all_reduce(torch.ones(1))
if phalanx.get_rank() == 0:
    phalanx.barrier()  # the extra barrier
else:
    time.sleep(60)  # busy elsewhere
phalanx.destroy_process_group()
