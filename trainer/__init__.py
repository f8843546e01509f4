"""The 3D-parallel torch trainer (DTensor TP, torch.distributed.pipelining, FSDP2) run inside each worker."""
