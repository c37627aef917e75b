"""Who is at the other end of a socket: /proc's TCP addresses in words, and unix sockets'
peers from the kernel's sock_diag (netlink), for the wait-for graph."""

from __future__ import annotations

import socket
import struct

from .. import clock


def address(hexaddr: str) -> str:
    host, port = hexaddr.split(":")
    if len(host) == 8:
        ip = socket.inet_ntop(socket.AF_INET, bytes.fromhex(host)[::-1])
    else:
        raw = bytes.fromhex(host)
        ip = socket.inet_ntop(
            socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        )
    return f"{ip}:{int(port, 16)}"


def unix_peers(timeout_s: float = 0.2) -> dict[str, str]:
    """inode -> peer inode of every connected unix socket, through sock_diag (empty if refused)."""
    peers: dict[str, str] = {}
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4)  # NETLINK_SOCK_DIAG
    except OSError:
        return peers
    with sock:
        sock.settimeout(timeout_s)
        # unix_diag_req: family, protocol, pad, states, ino, show (UDIAG_SHOW_PEER), cookie
        req = struct.pack("=BBHIII8x", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, 4)
        header = struct.pack("=IHHII", 16 + len(req), 20, 0x301, 1, 0)  # SOCK_DIAG_BY_FAMILY
        try:
            sock.send(header + req)
            deadline = clock.monotonic() + timeout_s
            while clock.monotonic() < deadline:
                data = sock.recv(1 << 16)
                offset = 0
                while offset + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, offset)
                    if kind == 3 or length < 16:  # NLMSG_DONE
                        return peers
                    if kind == 2:  # NLMSG_ERROR
                        return peers
                    _parse_unix_msg(data[offset + 16 : offset + length], peers)
                    offset += (length + 3) & ~3
        except OSError:
            pass
    return peers


def _parse_unix_msg(msg: bytes, peers: dict[str, str]) -> None:
    if len(msg) < 16:
        return
    (inode,) = struct.unpack_from("=I", msg, 4)
    offset = 16
    while offset + 4 <= len(msg):
        length, kind = struct.unpack_from("=HH", msg, offset)
        if length < 4:
            return
        if kind == 2 and length >= 8:  # UNIX_DIAG_PEER
            peers[str(inode)] = str(struct.unpack_from("=I", msg, offset + 4)[0])
        offset += (length + 3) & ~3
