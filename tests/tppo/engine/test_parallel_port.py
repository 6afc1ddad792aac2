"""The rendezvous port: held against other sockets while reserved, yet rank 0's store can listen on it."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys

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


WORLD_OF_ONE = """
import os, sys
import torch.distributed as dist
from tppo.engine.parallel import start_torch_distributed
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
start_torch_distributed("gloo", 10.0)
dist.all_reduce(t := __import__("torch").ones(2))
print(dist.get_world_size(), t.tolist())
"""


def test_a_world_of_one_needs_no_port_even_where_the_launcher_set_one():
    """A trainer of one rank starts even when the MASTER_PORT it was given is taken by another process's
    listening socket (a TCPStore there would fail with EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-c", WORLD_OF_ONE, str(port)], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "1 [1.0, 1.0]"
