import subprocess
import sys


def test_unbuilt_command_says_so_and_fails() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from mg.generate_server.cli import main; main()"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "not built yet" in result.stderr
