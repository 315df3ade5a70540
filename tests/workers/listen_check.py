"""Lists the addresses this rank's listening TCP sockets are bound to."""

import os

import sok_keras as sok

sok.init()

import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

from sok_keras import world  # noqa: E402


def _my_socket_inodes():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _decode(hex_addr):
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
    full = b"".join(words)
    if full[:12] == b"\0" * 10 + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in full[12:])
    return ":".join(full[i:i + 2].hex() for i in range(0, 16, 2))


# A collective first, so that every server is up.
total = world.communicator().all_reduce(tf.constant([1.0]), "listen/check")
mine = _my_socket_inodes()
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
        next(f)
        for line in f:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in mine:
                host, port = local.rsplit(":", 1)
                listening.append([_decode(host), int(port, 16)])
write_result({"listening": listening, "sum": float(total[0]),
              "bind_host": os.environ.get("SOK_BIND_HOST")})
