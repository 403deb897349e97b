"""Lightning strategies for genrl methods: :class:`FSDP2Strategy` shards every role of a method with FSDP2 on
Lightning's ``ModelParallelStrategy`` (DDP needs nothing of genrl: ``strategy: ddp``). See docs/distributed.md."""

from genrl.strategies.fsdp2 import FSDP2Strategy

__all__ = ["FSDP2Strategy"]
