"""A network namespace where Discord's host names mean a fake on this machine.

discord.py has no base-URL option, and a ``bothy serve`` subprocess cannot be handed an
aiohttp connector (``tests/fakes/discord.py`` does that for a bot in the test's own process).
So the subprocess runs where the real names lead to the fake (Linux, as root): in a network
and mount namespace of its own, made with ``unshare``, whose loopback is up, whose
``/etc/hosts`` (bind-mounted, in that mount namespace only) sends ``discord.com``,
``gateway.discord.gg`` and the resume host to 127.0.0.1, and whose port 443 is forwarded to
the fake's port in the test's namespace. The fake's throwaway CA is trusted through
``SSL_CERT_FILE``. discord.py then runs exactly as in production: the same URLs, TLS with
verification on, no connector and no attribute touched.

A :class:`Namespace` is held open by one small process (``unshare … cat``: it ends when the
test's process closes its stdin, or dies). Commands enter it with ``nsenter`` (which execs,
so the pid a test signals is the command's own). Sockets are made inside it from a thread
that joined it (``setns``); a socket keeps the namespace it was made in, so the test's event
loop serves them like any other. The namespace sees nothing of the test's loopback unless a
port is forwarded:

* :meth:`Namespace.expose` — a port the test serves (the scripted model server) reachable at
  the same number inside;
* :meth:`Namespace.reach` — a port something inside listens on (the daemon's webhook door)
  reachable from the test, at the port it returns.

Forwarding copies bytes; an abort (RST) on one side aborts the other, so a gateway the fake
drops is dropped for the daemon too. Where namespaces cannot be made (not root, no
``unshare``, a sandbox refusing them) :meth:`Namespace.open` raises
:class:`NamespaceUnavailable` with the reason, and the fixtures skip with it.

For tests, ``tests/conftest.py`` has the fixture ``discord_network`` (a
:class:`DiscordNetwork`: the fake, its namespace, and :meth:`DiscordNetwork.attach` that
makes a :class:`~tests.fakes.site.Site` run its ``bothy`` commands inside).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.fakes.discord import BOT_TOKEN, HOSTS, Certificates, FakeDiscord
from tests.fakes.site import Site

_CLONE_NEWNET = 0x40000000
_HTTPS_PORT = 443
_OPEN_S = 10.0
_CHUNK = 65536


class NamespaceUnavailable(Exception):
    """Network namespaces cannot be made here; the message says why."""


def _setns(net_path: str) -> None:
    """Move the calling thread into the network namespace at ``net_path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(net_path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({net_path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


class Namespace:
    """A network + mount namespace with its own loopback and ``/etc/hosts``."""

    def __init__(self, holder: asyncio.subprocess.Process, directory: Path) -> None:
        self._holder = holder
        self._directory = directory
        # One thread that joined the namespace makes every socket that must live in it.
        self._inside = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="netns",
            initializer=_setns, initargs=(f"/proc/{holder.pid}/ns/net",))
        self._servers: list[asyncio.Server] = []
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def pid(self) -> int:
        """The process holding the namespace open (``nsenter --target`` it)."""
        return self._holder.pid

    @classmethod
    async def open(cls, directory: Path, *, names: Iterable[str]) -> Namespace:
        """Make the namespace, its loopback up and ``names`` resolving to 127.0.0.1 in it.

        Raises NamespaceUnavailable (with the reason) where that is not possible."""
        if os.geteuid() != 0:
            raise NamespaceUnavailable("network namespaces need root (CI runs as root)")
        missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
        if missing:
            raise NamespaceUnavailable(f"missing {', '.join(missing)} (util-linux, iproute2)")
        hosts = directory / "hosts"
        await asyncio.to_thread(_write_hosts, hosts, names)
        script = ('ip link set lo up && mount --bind "$0" /etc/hosts && echo ready'
                  ' && exec cat >/dev/null')
        holder = await asyncio.create_subprocess_exec(
            "unshare", "--net", "--mount", "sh", "-c", script, str(hosts),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert holder.stdout is not None and holder.stderr is not None
        try:
            async with asyncio.timeout(_OPEN_S):
                said = await holder.stdout.readline()
        except TimeoutError:
            said = b""
        if said.strip() != b"ready":
            with contextlib.suppress(ProcessLookupError):
                holder.kill()
            _, stderr = await holder.communicate()
            reason = stderr.decode(errors="replace").strip() or "no reason given"
            raise NamespaceUnavailable(f"unshare --net --mount failed: {reason}")
        return cls(holder, directory)

    def argv(self, argv: Iterable[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["nsenter", f"--target={self.pid}", "--net", "--mount", "--", *argv]

    async def _socket_inside(self) -> socket.socket:
        """A TCP socket in the namespace. Its protocol is named: asyncio sets TCP_NODELAY only
        on a socket whose ``proto`` says TCP, and one made with ``socket.socket()`` (proto 0)
        passed on Nagle's algorithm to every connection it accepted: ~40 ms of delayed ACK
        on the first request of each TLS connection through it, Discord's login and gateway
        included, that no real network path adds (bench_startup)."""
        loop = asyncio.get_running_loop()
        made = await loop.run_in_executor(
            self._inside, socket.socket, socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        made.setblocking(False)
        return made

    async def expose(self, port: int, *, inside_port: int | None = None) -> None:
        """Make the test's 127.0.0.1:``port`` reachable inside at ``inside_port`` (default:
        the same number)."""
        listening = await self._socket_inside()
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", inside_port or port))
        listening.listen(64)

        async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                outer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                writer.transport.abort()
                return
            await self._splice((reader, writer), outer)

        self._servers.append(await asyncio.start_server(forward, sock=listening))

    async def reach(self, inside_port: int) -> int:
        """A port on the test's 127.0.0.1 that leads to 127.0.0.1:``inside_port`` inside."""
        loop = asyncio.get_running_loop()

        async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            inner = await self._socket_inside()
            try:
                await loop.sock_connect(inner, ("127.0.0.1", inside_port))
                connected = await asyncio.open_connection(sock=inner)
            except OSError:
                inner.close()
                writer.transport.abort()
                return
            await self._splice((reader, writer), connected)

        server = await asyncio.start_server(forward, "127.0.0.1", 0)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def _splice(
        self,
        one: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        other: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            await asyncio.gather(_copy(one[0], other[1]), _copy(other[0], one[1]))
        finally:
            self._pipes.discard(task)
            for writer in (one[1], other[1]):
                writer.close()

    async def close(self) -> None:
        """Stop forwarding and end the holder (which ends the namespace with its last user)."""
        for server in self._servers:
            server.close()
        for task in list(self._pipes):
            task.cancel()
        if self._pipes:
            await asyncio.wait(set(self._pipes))
        for server in self._servers:
            await server.wait_closed()
        self._inside.shutdown(wait=True)
        holder = self._holder
        if holder.returncode is None:
            assert holder.stdin is not None
            holder.stdin.close()
            try:
                async with asyncio.timeout(_OPEN_S):
                    await holder.wait()
            except TimeoutError:
                holder.kill()
                await holder.wait()


def _write_hosts(path: Path, names: Iterable[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("127.0.0.1 localhost\n::1 localhost\n"
                    + "".join(f"127.0.0.1 {name}\n" for name in names))


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes from ``reader`` to ``writer`` until EOF (then close it) or an error (then abort
    it: a dropped connection stays dropped, it does not become a clean close)."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except OSError:
        writer.transport.abort()
        return
    with contextlib.suppress(OSError):
        if writer.can_write_eof():
            writer.write_eof()


@dataclass
class DiscordNetwork:
    """A fake Discord that ``bothy`` subprocesses reach at its real host names, over TLS.

    ``fake`` is the :class:`FakeDiscord` (drive it and read it as in-process tests do);
    ``namespace`` the :class:`Namespace` where ``discord.com`` & co lead to it. Typical use::

        site = await discord_network.attach(Site(tmp_path, server.base_url, chat=...),
                                            ports=[server.port])
        async with Shell(site) as shell:
            serving = await start_serve(shell)     # bothy serve, inside the namespace
            await discord_network.fake.send_mention(ALICE_ID, CHANNEL_ID, "hello")
    """

    fake: FakeDiscord
    namespace: Namespace
    certificates: Certificates

    async def attach(self, site: Site, *, ports: Iterable[int] = ()) -> Site:
        """Make ``site`` run every ``bothy`` command inside the namespace, trusting the fake's
        CA and holding the fake's bot token; ``ports`` of this process (the model server's)
        are exposed inside at the same numbers. Returns ``site``."""
        for port in ports:
            await self.namespace.expose(port)
        site.launch_prefix = self.namespace.argv(())
        site.extra_env.update({"SSL_CERT_FILE": str(self.certificates.ca_pem),
                               "DISCORD_BOT_TOKEN": BOT_TOKEN})
        return site

    async def reach(self, inside_port: int) -> int:
        """See :meth:`Namespace.reach` (e.g. for the daemon's webhook door)."""
        return await self.namespace.reach(inside_port)


@contextlib.asynccontextmanager
async def open_discord_network(
    directory: Path, certificates: Certificates
) -> AsyncIterator[DiscordNetwork]:
    """A :class:`FakeDiscord` on this loopback and a namespace whose port 443 leads to it;
    raises NamespaceUnavailable (before anything started) where there can be no namespace."""
    namespace = await Namespace.open(directory, names=HOSTS)
    try:
        async with FakeDiscord(certificates) as fake:
            await namespace.expose(fake.port, inside_port=_HTTPS_PORT)
            yield DiscordNetwork(fake, namespace, certificates)
    finally:
        await namespace.close()
