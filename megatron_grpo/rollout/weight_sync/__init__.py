"""Weight streaming: the trainer's weights to every generation replica after each update.

Trainer ranks hold a :class:`WeightSender`, generator ranks a :class:`WeightReceiver`; both are
built together (a collective) with a ``sync_group`` of the sending trainer rank (``source``)
and every generator rank, and (keyword ``notice_group``) a gloo group of the same ranks for each
version's header, which goes first (``receiver``: why)::

    # trainer ranks                          # generator ranks
    sender = WeightSender(model, layout,     receiver = WeightReceiver(model, layout,
                          group, source)                               group, source)
    ...optimizer step...                     receiver.begin()  # the header's receive
    metrics = sender.send(version)           while not receiver.poll(): engine steps
                                             metrics = receiver.swap()  # at a step boundary

What travels: every parameter as its TP=EP=1 global tensor (``shards``: gathered from the
trainer's TP / EP / expert-TP shards, cut to the generator's), in buckets of a fixed byte size
(``plan``), broadcast from the source over NCCL (gloo on CPU). The generators decode with the
old weights until :meth:`WeightReceiver.swap` copies the complete new version in (a staging
copy of the parameters: the double buffer). Both sides' metrics: ``rollout/weight_sync_seconds``
and ``rollout/weight_sync_gib`` (the receiver's also ``rollout/weight_swap_seconds``, the
generators' stop, and ``version``, the policy version of the new weights).

Memory: the receiver keeps a staging copy of its parameters and two bucket buffers; the source
two bucket buffers, each bucket's gathered shards and the global tensors of the tensors being
sent (the largest tensor at least: a tensor larger than a bucket is assembled once and sent in
several). Generators and trainer use the same ``params_dtype`` (weights are copied bit for bit).
The broadcast runs on its own communicator next to the generators' TP collectives (each on
its own stream).
"""

from megatron_grpo.rollout.weight_sync.plan import Bucket, Segment, TensorMeta, plan_buckets
from megatron_grpo.rollout.weight_sync.receiver import WeightReceiver
from megatron_grpo.rollout.weight_sync.sender import DEFAULT_BUCKET_BYTES, WeightSender
from megatron_grpo.rollout.weight_sync.shards import Coords, SyncTensor, sync_tensors

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "Coords",
    "Segment",
    "SyncTensor",
    "TensorMeta",
    "WeightReceiver",
    "WeightSender",
    "plan_buckets",
    "sync_tensors",
]
