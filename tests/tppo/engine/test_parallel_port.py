"""The rendezvous port: held against other sockets while reserved, yet rank 0's store can listen on it."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from tppo.engine.parallel import reserved_port


def _plain_bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_a_store_listens_on_the_reserved_port_that_others_cannot_take():
    with reserved_port() as port:
        with pytest.raises(OSError):  # another process asking for this port now is refused
            _plain_bind(port)
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
        store.set("rank0", "up")
        assert store.get("rank0") == b"up"


def test_the_port_is_released_after_the_block():
    with reserved_port() as port:
        pass
    _plain_bind(port)
