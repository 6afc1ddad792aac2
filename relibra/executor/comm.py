"""Point-to-point traffic of the executor over an explicitly passed EP process group.

- `push_replicas(w1_home, w2_home, exchange, group)`: an autograd function. Forward: every owner sends the
  weights of its replicated experts, every holder receives them into its R replica slots (empty slots hold
  zeros and get no tokens). Backward: every holder sends the replica gradients back, every owner adds them
  into the gradient of its home slots in (holder rank, replica slot) order, a fixed order, so the result is
  deterministic. The fold therefore goes through autograd into the owner's `param.grad` / `main_grad`
  BEFORE Megatron's finalize_model_grads hands expert gradients to the data-parallel reduction. Activation
  recompute re-runs the forward inside the backward and so re-pushes the weights.
- `move_slots(tensor_J, moves, group)`: in-place permutation of a stacked slot tensor's rows across ranks
  (expert migration); used for weights and for every optimizer state tensor shaped like them. In two halves for
  a migration that runs behind other work: `post_slot_moves` posts the transfers and returns at once,
  `land_slot_moves` waits for them and rewrites the rows. Between the two the source rows must not change.

Departure from the paper: the push runs when the layer's experts compute (not overlapped with attention),
and the fold runs inside the layer's backward (not overlapped with attention backward).

Legend: H home slots, R replica slots, F expert FFN size, D hidden size, J slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from relibra.executor.tables import MigrationMoves, ReplicaExchange

__all__ = ["SlotTransfer", "land_slot_moves", "move_slots", "p2p", "post_slot_moves", "push_replicas"]


def p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group) -> None:
    """Post every send (tensor, peer EP rank) and receive (buffer, peer EP rank) of `group` at once and wait."""
    for req in _post(sends, recvs, group):
        req.wait()


def _post(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group) -> list:
    """Post the transfers as one batch; the returned requests complete them."""
    ops = [
        dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer), group) for t, peer in sends
    ]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


class _PushReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w1_home, w2_home, exchange: ReplicaExchange, num_replicas: int, group):
        ctx.exchange, ctx.group = exchange, group
        ctx.home_shapes = (w1_home.shape, w2_home.shape)
        w1_rep = w1_home.new_zeros(num_replicas, *w1_home.shape[1:])
        w2_rep = w2_home.new_zeros(num_replicas, *w2_home.shape[1:])
        sends = [(w[j], peer) for peer, j in exchange.sends for w in (w1_home, w2_home)]
        recvs = [(w[r], peer) for peer, r in exchange.recvs for w in (w1_rep, w2_rep)]
        p2p(sends, recvs, group)
        return w1_rep, w2_rep

    @staticmethod
    def backward(ctx, g1_rep, g2_rep):
        ex = ctx.exchange
        s1, s2 = ctx.home_shapes
        g1_rep = g1_rep if g1_rep is not None else torch.zeros(0)
        g2_rep = g2_rep if g2_rep is not None else torch.zeros(0)
        ref = g1_rep if g1_rep.numel() else g2_rep
        # Holders send back what their replica slots received; owners collect one buffer per replica.
        bufs = [(ref.new_empty(s1[1:]), ref.new_empty(s2[1:])) for _ in ex.sends]
        sends = []
        for peer, r in ex.recvs:
            sends += [(_or_zeros(g1_rep, r, s1), peer), (_or_zeros(g2_rep, r, s2), peer)]
        recvs = [(b, peer) for (peer, _), pair in zip(ex.sends, bufs, strict=True) for b in pair]
        p2p(sends, recvs, ctx.group)
        if not ex.sends:
            return None, None, None, None, None
        grad1, grad2 = ref.new_zeros(s1), ref.new_zeros(s2)
        for (_peer, j), (b1, b2) in zip(ex.sends, bufs, strict=True):  # (holder, replica slot) order
            grad1[j] += b1
            grad2[j] += b2
        return grad1, grad2, None, None, None


def _or_zeros(grad_R: torch.Tensor, r: int, shape: torch.Size) -> torch.Tensor:
    return grad_R[r] if grad_R.numel() else torch.zeros(shape[1:])


def push_replicas(
    w1_home: torch.Tensor, w2_home: torch.Tensor, exchange: ReplicaExchange, num_replicas: int, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W1 [R, 2F, D], W2 [R, D, F]) of this rank's replica slots; collective over `group` (every rank calls it)."""
    return _PushReplicas.apply(w1_home, w2_home, exchange, num_replicas, group)


@dataclass
class SlotTransfer:
    """The cross-rank half of one slot move in flight: `recv_RX` receives `moves.recvs` in order, `sent` keeps
    the send buffers alive until `requests` complete."""

    moves: MigrationMoves
    recv_RX: torch.Tensor
    sent: list[torch.Tensor]
    requests: list
    bytes_sent: int


@torch.no_grad()
def post_slot_moves(tensor_J: torch.Tensor, moves: MigrationMoves, group) -> SlotTransfer:
    """Post the sends and receives of `moves` for the rows of `tensor_J`; collective over `group`, returns at once."""
    sent = [tensor_J[jo] for _peer, jo in moves.sends]  # rows of the leading dim: contiguous views
    recv_RX = tensor_J.new_empty(len(moves.recvs), *tensor_J.shape[1:])
    requests = _post(
        list(zip(sent, (peer for peer, _ in moves.sends), strict=True)),
        [(recv_RX[r], peer) for r, (peer, _j) in enumerate(moves.recvs)],
        group,
    )
    nbytes = sum(t.numel() * t.element_size() for t in sent)
    return SlotTransfer(moves, recv_RX, sent, requests, nbytes)


@torch.no_grad()
def land_slot_moves(tensor_J: torch.Tensor, transfer: SlotTransfer) -> None:
    """Wait for `transfer` and rewrite the rows of `tensor_J` (the tensor it was posted for) in place."""
    for req in transfer.requests:
        req.wait()
    moves = transfer.moves
    if moves.local:
        dst, src = (list(x) for x in zip(*moves.local, strict=True))
        tensor_J[dst] = tensor_J[src]  # advanced indexing reads every source row before writing
    if moves.recvs:
        tensor_J[[j for _peer, j in moves.recvs]] = transfer.recv_RX
    transfer.requests, transfer.sent = [], []


def move_slots(tensor_J: torch.Tensor, moves: MigrationMoves, group) -> int:
    """Rewrite the slot rows of `tensor_J` in place as `moves` says; collective over `group`. Returns bytes sent."""
    transfer = post_slot_moves(tensor_J, moves, group)
    land_slot_moves(tensor_J, transfer)
    return transfer.bytes_sent
