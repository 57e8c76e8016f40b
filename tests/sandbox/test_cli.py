"""``lightning-rl sandbox exec`` and ``doctor``: a command in a fresh sandbox as a try's would run, its exit code
passed on, the deadline and the sandbox's own failure each with a code of their own."""

from __future__ import annotations

from click.testing import CliRunner

from lightning_rl.cli import main
from lightning_rl.cli.sandbox import EXIT_DEADLINE, EXIT_SANDBOX


def test_exec_runs_in_a_copy_of_the_task_folder_and_passes_the_exit_code_on(tmp_path):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "data.txt").write_text("42\n")
    done = CliRunner().invoke(main, ["sandbox", "exec", "--dir", str(tmp_path / "task"), "--", "sh", "-c",
                                     "cat data.txt; echo changed > data.txt; exit 7"])
    assert done.exit_code == 7 and done.output.startswith("42\n"), done.output
    assert (tmp_path / "task" / "data.txt").read_text() == "42\n"  # the try's copy changed, not the task


def test_exec_says_the_deadline_and_a_sandbox_failure_apart_from_the_commands_code(monkeypatch):
    done = CliRunner().invoke(main, ["sandbox", "exec", "--timeout", "1", "--", "sh", "-c", "trap '' TERM; sleep 30"])
    assert done.exit_code == EXIT_DEADLINE and "deadline of 1 s" in done.output
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found: the sandbox cannot start
    done = CliRunner().invoke(main, ["sandbox", "exec", "--", "true"])
    assert done.exit_code == EXIT_SANDBOX and "bubblewrap is not installed" in done.output
    doctor = CliRunner().invoke(main, ["sandbox", "doctor"])
    assert doctor.exit_code == 1 and "bwrap: does not work: bubblewrap is not installed" in doctor.output
    monkeypatch.undo()
    assert CliRunner().invoke(main, ["sandbox", "doctor"]).output.startswith("bwrap: works")


def test_exec_with_the_gateway_reaches_it_and_nothing_else(tmp_path):
    """--network gateway: the gateway's URL works inside, and another port of the host's loopback does not."""
    import http.server
    import socket
    import threading

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"gateway says hi")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    probe = ("import socket, urllib.request, sys\n"
             f"print(urllib.request.urlopen('{url}/v1', timeout=10).read().decode())\n"
             "try:\n"
             f"    socket.create_connection(('127.0.0.1', {other.getsockname()[1]}), timeout=5); print('reached')\n"
             "except OSError as exc:\n"
             "    print('refused')\n")
    try:
        done = CliRunner().invoke(main, ["sandbox", "exec", "--network", "gateway", "--gateway-url", url, "--",
                                         "python3", "-c", probe])
        assert done.exit_code == 0 and done.output.split() == ["gateway", "says", "hi", "refused"], done.output
    finally:
        server.shutdown()
        other.close()


def test_exec_refuses_bad_network_input_in_one_line():
    import tempfile
    from pathlib import Path

    before = set(Path(tempfile.gettempdir()).glob("lrl-sandbox-*"))
    done = CliRunner().invoke(main, ["sandbox", "exec", "--network", "gateway", "--", "true"],
                              env={"LIGHTNING_RL_GATEWAY_URL": ""})
    assert done.exit_code == 1 and "--gateway-url" in done.output and done.output.count("\n") == 1
    done = CliRunner().invoke(main, ["sandbox", "exec", "--network", "gateway", "--gateway-url", "nowhere", "--",
                                     "true"])
    assert done.exit_code == 1 and "http://HOST:PORT" in done.output
    assert not set(Path(tempfile.gettempdir()).glob("lrl-sandbox-*")) - before  # refused before any folder was made
