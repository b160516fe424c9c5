"""The classic mechanics made explicit, beside the core path: the torch.distributed collectives
on mesh axes, single-process DataParallel, SyncBatchNorm. Nothing in the training path imports them."""
