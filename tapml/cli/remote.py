"""Remote-device commands: ``tapml serve``, ``tapml registry``, ``tapml devices``."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Optional

import typer

from tapml.cli.common import EXIT_OK, JsonOpt, TokenFileOpt, app, command, console, fail, out, write_json
from tapml.text import shown

SERVE_PLATFORMS = ("wgpu, wgpu:vulkan, wgpu:gl, wgpu:metal, wgpu:dx12, browser, reference, or an external backend "
                   "(iree:vulkan, iree:llvm-cpu, ort, tinygrad:webgpu, tinygrad:cpu, an installed PREFIX[:DEVICE], "
                   "path/file.py:Class)")


def _log_to_stderr(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tapml serve: %(message)s"))
    logger = logging.getLogger("tapml.serve")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False


@app.command()
@command
def serve(platform: str = typer.Option("wgpu", "--platform", "-p", help=SERVE_PLATFORMS),
          host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs a token"),
          port: int = typer.Option(18861, "--port", help="TCP port; 0 picks a free one (printed)"),
          token_file: Optional[str] = TokenFileOpt,
          register: Optional[str] = typer.Option(None, "--register", help="Announce to an rpyc registry: [udp://|tcp://]HOST[:PORT]"),
          max_message_mib: int = typer.Option(1024, "--max-message-mib", help="Refuse tensor messages larger than this"),
          max_request_mib: int = typer.Option(64, "--max-request-mib",
                                              help="Refuse control messages (JSON requests: graphs, programs) larger than this"),
          max_request_elements: int = typer.Option(1 << 21, "--max-request-elements",
                                                   help="Refuse JSON requests holding more values than this (counted before parsing)"),
          timeout: float = typer.Option(300.0, "--timeout", help="Seconds a run may wait for its input tensors"),
          auth_timeout: float = typer.Option(10.0, "--auth-timeout", help="Seconds a new connection has to authenticate"),
          max_invocations: int = typer.Option(1 << 32, "--max-invocations",
                                              help="Refuse programs dispatching more shader invocations than this"),
          max_buffer_mib: int = typer.Option(4096, "--max-buffer-mib",
                                             help="Refuse programs declaring more device buffer MiB than this"),
          run_timeout: float = typer.Option(120.0, "--run-timeout",
                                            help="Seconds one compile or run may take (then its device worker is "
                                                 "killed) and a request may wait for a busy device"),
          no_launch: bool = typer.Option(False, "--no-launch", help="browser: do not start Chromium; print the page URL to open"),
          verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every connection")):
    """Serve a local device to tapml clients (targets remote://HOST:PORT)."""
    from tapml.errors import TapmlError
    from tapml.remote.limits import ServerLimits
    from tapml.remote.server import is_loopback, parse_registry
    from tapml.remote.server import serve as run_server
    from tapml.driving.targets import check_target, open_target, read_token
    if platform.startswith("remote://"):
        fail("serve exposes a device of this machine; --platform cannot be remote://")
    check_target(platform)
    if no_launch and platform != "browser":
        fail("--no-launch only applies to --platform browser")
    if not 0 <= port < 65536:
        fail(f"--port {port} is out of range (0-65535; 0 picks a free port)")
    if max_message_mib < 1 or max_request_mib < 1 or max_request_elements < 1:
        fail("--max-message-mib, --max-request-mib and --max-request-elements must be at least 1")
    if timeout <= 0 or auth_timeout <= 0:
        fail("--timeout and --auth-timeout must be positive")
    if max_invocations < 1 or max_buffer_mib < 1 or not 0 < run_timeout < 1e6:
        fail("--max-invocations and --max-buffer-mib must be at least 1, --run-timeout a positive number of seconds")
    if register:
        parse_registry(register)
    token = read_token(token_file)
    limits = ServerLimits(max_invocations, max_buffer_mib << 20, run_timeout, max_request_mib << 20, max_request_elements)
    if not is_loopback(host) and not token:
        console.print(f"[bold yellow]warning:[/] serving on {host} without a token: anyone who can reach this "
                      "port can run programs on this device; pass --token-file or set TAPML_TOKEN", highlight=False)
    _log_to_stderr(verbose)
    if platform == "browser" and no_launch:
        try:
            from tapml.platforms.browser import BrowserPlatform
        except ImportError as e:
            raise TapmlError(f"platform browser is not available: {e}") from None
        device = BrowserPlatform(launch=False, host=host)  # the page is served where a person can reach it
    elif platform == "browser":
        device = open_target(platform)
    else:
        from tapml.remote.device_worker import WorkerPlatform
        # killable when a run passes --run-timeout; its address space bounded by the limits
        device = WorkerPlatform(platform, timeout=run_timeout, address_space=limits.worker_address_space())

    def announce(bound_host: str, bound_port: int) -> None:
        adapter = "adapter: the page that opens the URL" if no_launch else device.caps().get("adapter", "?")
        host_shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        if no_launch:  # only once the port is ours: a URL printed before a failed listen leads nowhere
            print(f"open {device.url} in a browser with WebGPU to attach it", flush=True)
        print(f"tapml serve: {platform} ({adapter}) listening on {host_shown}:{bound_port}"
              + (" (token required)" if token else " (no token)"), flush=True)

    def registered(ok: bool) -> None:
        if ok:
            print(f"tapml serve: announced to the registry at {register} (renewed while serving); "
                  f"`tapml devices --registry {register}` lists it", flush=True)
        else:
            print(f"tapml serve: the registry at {register} does not answer; announcing again every few "
                  "seconds", flush=True)

    try:
        run_server(device, platform, host=host, port=port, token=token, max_message=max_message_mib << 20,
                   register=register, timeout=timeout, on_listen=announce,
                   lazy_caps=no_launch, auth_timeout=auth_timeout, on_stop=device.close,
                   limits=limits, on_register=registered if register else None)
    finally:
        device.close()
    print("tapml serve: stopped", flush=True)


@app.command()
@command
def registry(host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0 for a LAN)"),
             port: int = typer.Option(18811, "--port", help="Port; 0 picks a free one (printed)"),
             mode: str = typer.Option("udp", "--mode", help="udp or tcp"),
             prune_s: int = typer.Option(240, "--prune-timeout", help="Forget devices silent for this many seconds")):
    """Run an rpyc registry that `tapml serve --register` announces devices to."""
    from rpyc.utils.registry import TCPRegistryServer, UDPRegistryServer

    from tapml.remote.server import SERVICE_NAME
    if mode not in ("udp", "tcp"):
        fail(f"--mode {mode!r}: use udp or tcp")
    if not 0 <= port < 65536:
        fail(f"--port {port} is out of range (0-65535)")
    quiet = logging.getLogger("tapml.registry.server")
    quiet.setLevel(logging.CRITICAL)
    cls = UDPRegistryServer if mode == "udp" else TCPRegistryServer
    try:
        server = cls(host=host, port=port, pruning_timeout=prune_s, logger=quiet, allow_listing=True)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port")

    def stop(signum, frame):
        server.active = False

    def added(name, address):
        if name == SERVICE_NAME:
            print(f"tapml registry: remote://{address[0]}:{address[1]} announced itself", flush=True)

    def removed(name, address):
        if name == SERVICE_NAME:
            print(f"tapml registry: remote://{address[0]}:{address[1]} no longer announced (stopped, or silent for {prune_s} s)",
                  flush=True)

    server.on_service_added, server.on_service_removed = added, removed

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.sock.settimeout(0.5)  # a stop request is seen within 0.5 s, not only when the next announcement comes
    print(f"tapml registry listening on {mode}://{server.sock.getsockname()[0]}:{server.port}", flush=True)
    server.start()
    print("tapml registry: stopped", flush=True)


@app.command()
@command
def devices(registry_spec: str = typer.Option("udp://255.255.255.255:18811", "--registry",
                                              help="[udp://|tcp://]HOST[:PORT] of the registry (default: UDP broadcast)"),
            token_file: Optional[str] = TokenFileOpt, json_out: Optional[str] = JsonOpt,
            timeout: float = typer.Option(2.0, "--timeout", help="Seconds to wait for the registry and each device")):
    """List the devices announced to a registry, with their caps."""
    from tapml.remote.server import SERVICE_NAME, parse_announcement, registry_client
    from tapml.driving.targets import read_token
    if not timeout > 0:
        fail(f"--timeout {timeout:g} must be a positive number of seconds")
    token = read_token(token_file)
    client = registry_client(registry_spec, timeout)
    announced = {}
    try:
        addresses = {tuple(a) for a in client.discover(SERVICE_NAME)}
        try:
            names = client.list() or ()
        except Exception:  # noqa: BLE001 - listing off or reply too long: fall back to probing
            names = ()
        for name in names:
            info = parse_announcement(name)
            if info is not None:
                for a in client.discover(name):
                    announced[tuple(a)] = info
    except OSError as e:
        fail(f"cannot reach the registry at {registry_spec}: {e.strerror or e}; start one with `tapml registry`")
    rows = [_probe(host, int(port), announced.get((host, port), {}), token, timeout)
            for host, port in sorted(addresses)]
    if json_out:
        write_json(rows, json_out)
        if json_out == "-":
            return
    if not rows:
        out.print(f"no devices registered at {shown(registry_spec)}")
        raise typer.Exit(EXIT_OK)
    from rich.table import Table
    table = Table(title=f"devices at {shown(registry_spec)}")
    for col in ("target", "platform", "adapter", "backend", "features", "max storage buffer", "status"):
        table.add_column(col, overflow="fold")
    for r in rows:
        limit = r["limits"].get("maxStorageBufferBindingSize") or r["limits"].get("max-storage-buffer-binding-size")
        features = r["features"] if isinstance(r["features"], list) else [r["features"]]
        table.add_row(*map(shown, (r["target"], r["platform"], r["adapter"], r["backend"], ", ".join(map(str, features)))),
                      f"{limit / 2**20:.0f} MiB" if isinstance(limit, (int, float)) else "", shown(r["status"]))
    out.print(table)


def _probe(host: str, port: int, announced: dict, token: str | None, timeout: float) -> dict:
    """What the registry announced for one device, updated with its live caps when the token
    lets us in; ``status`` says why not otherwise."""
    from tapml.errors import TapmlError
    from tapml.remote.announcement import check_announcement
    from tapml.remote.client import RemotePlatform
    # what a registry announces is anyone's word: text as text, features as a list of text
    features = announced.get("features")
    row = {"target": f"remote://{host}:{port}", "platform": str(announced.get("platform", "?")),
           "adapter": str(announced.get("adapter") or ""), "backend": str(announced.get("backend") or ""),
           "features": [str(f) for f in features] if isinstance(features, list) else [], "limits": {}, "dtypes": [],
           "status": "ok"}
    try:
        with RemotePlatform(host, port, token=token, timeout=timeout, connect_timeout=timeout) as device:
            caps = device.caps()
            # the device's own word: held to the same types as an announcement
            announced = check_announcement({"platform": device.info.get("platform", row["platform"]),
                                        **{k: caps.get(k) for k in ("adapter", "backend", "features")}})
            limits, dtypes = caps.get("limits", {}), caps.get("dtypes", [])
            if announced is None or not isinstance(limits, dict) or type(dtypes) is not list:
                row["status"] = "the device's caps are malformed (a field of the wrong type)"
            else:
                row.update(platform=announced.get("platform", row["platform"]), adapter=announced.get("adapter", ""),
                           backend=announced.get("backend", ""), features=announced.get("features", []),
                           limits=dict(limits), dtypes=[str(d) for d in dtypes])
    except TapmlError as e:
        row["status"] = str(e)
    return row
