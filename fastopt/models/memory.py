"""Per-node memory and mailbox, shared by the memory-based models (TGN, JODIE, APAN).

Semantics (no leakage within a batch): an event delivers a mail to both endpoints *after* the
batch is trained on; a node's stored memory absorbs its pending mail the next time the node
takes part in a positive event. Embeddings of any node (negatives included) use the memory "as
if updated" with its pending mail, computed on the fly with gradients, and never written.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["NodeMemory"]


class NodeMemory(nn.Module):
    """Memory ``[N, dim]``, last-update times, and a mailbox of ``slots`` mails per node.

    The state is kept in buffers, so it is part of ``state_dict`` and of every checkpoint.
    With one slot the mailbox holds the last mail (TGN, JODIE); with several it is a ring buffer
    of the most recent mails (APAN).
    """

    def __init__(self, num_nodes: int, dim: int, mail_dim: int, slots: int = 1) -> None:
        super().__init__()
        self.num_nodes, self.dim, self.mail_dim, self.slots = num_nodes, dim, mail_dim, slots
        self.register_buffer("memory", torch.zeros(num_nodes, dim))
        self.register_buffer("last_update", torch.zeros(num_nodes))
        self.register_buffer("mails", torch.zeros(num_nodes, slots, mail_dim))
        self.register_buffer("mail_ts", torch.zeros(num_nodes, slots))
        self.register_buffer("mail_count", torch.zeros(num_nodes, dtype=torch.long))
        self.register_buffer("pending", torch.zeros(num_nodes, dtype=torch.bool))

    def reset(self) -> None:
        """Forget everything (start of an epoch)."""
        for buf in (self.memory, self.last_update, self.mails, self.mail_ts, self.mail_count, self.pending):
            buf.zero_()

    def mail_mask(self, nodes: torch.Tensor) -> torch.Tensor:
        """``[n, slots]`` bool: which mailbox slots of ``nodes`` hold a mail."""
        slot = torch.arange(self.slots, device=nodes.device)
        return slot.unsqueeze(0) < self.mail_count[nodes].clamp(max=self.slots).unsqueeze(1)

    @torch.no_grad()
    def write(self, nodes: torch.Tensor, memory: torch.Tensor, times: torch.Tensor) -> None:
        """Store updated memory for ``nodes`` and mark their mail as absorbed (a repeated id must
        come with the same row each time)."""
        self.memory[nodes] = memory.detach()
        self.last_update[nodes] = times
        self.pending.index_fill_(0, nodes, False)  # a fill, no host scalar copied (capturable)

    @torch.no_grad()
    def deliver(self, nodes: torch.Tensor, mails: torch.Tensor, times: torch.Tensor) -> None:
        """Append mails in event order; with one slot the last mail per node wins.

        Works on the batch only (never on all N nodes) and never reads a size back to the host:
        a mail that does not survive (older than a node's last ``slots`` mails of the batch)
        repeats the write of its node's newest mail, so every write to a slot stores one value.
        """
        n = nodes.numel()
        if n == 0:
            return
        order = torch.sort(nodes, stable=True)
        ids, src = order.values, order.indices
        pos = torch.arange(n, device=nodes.device)
        new_group = torch.ones(n, dtype=torch.bool, device=nodes.device)
        new_group[1:] = ids[1:] != ids[:-1]
        group_end = torch.ones_like(new_group)
        group_end[:-1] = new_group[1:]
        first = torch.cummax(torch.where(new_group, pos, 0), 0).values
        last = torch.cummin(torch.where(group_end, pos, n).flip(0), 0).values.flip(0)
        rank = pos - first  # occurrence index of each mail among its node's mails
        keep = rank >= last - first + 1 - self.slots  # the last `slots` mails of each node survive
        slot = (self.mail_count[ids] + rank) % self.slots
        writer = torch.where(keep, pos, last)
        self.mails[ids, slot[writer]] = mails[src[writer]]
        self.mail_ts[ids, slot[writer]] = times[src[writer]]
        self.mail_count.index_add_(0, ids, torch.ones_like(ids))
        self.pending.index_fill_(0, ids, True)

    def latest_mail(self, nodes: torch.Tensor):
        """The most recent mail and its time for each node (slot before the write position)."""
        slot = (self.mail_count[nodes] - 1).clamp(min=0) % self.slots
        return self.mails[nodes, slot], self.mail_ts[nodes, slot]
