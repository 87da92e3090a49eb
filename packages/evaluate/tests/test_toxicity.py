"""`mg-eval toxicity` and its scorers: the built-in word list (exact shares), a word-list
file, a command and a local HTTP endpoint give the scores they are defined to; a scorer
that answers wrongly is a one-line error naming it."""

from __future__ import annotations

import json
import shlex
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from mg.evaluate.cli import main
from mg.evaluate.errors import EvalInputError
from mg.evaluate.toxicity import (
    WORDS,
    CommandScorer,
    HttpScorer,
    WordListScorer,
    scorer_from_spec,
    words_of,
)

TEXTS = ["You stupid fool, I will kill you.", "A lovely day in the garden.", "..."]


def test_word_list_score_is_the_share_of_listed_words():
    assert words_of("You stupid fool, I'll kill you.") == [
        "you",
        "stupid",
        "fool",
        "i'll",
        "kill",
        "you",
    ]
    assert WordListScorer().score(TEXTS) == [3 / 7, 0.0, 0.0]
    assert {"kill", "villain", "damned"} <= WORDS


def test_word_list_from_a_file(tmp_path):
    words = tmp_path / "words.txt"
    words.write_text("Garden\n\nlovely\n")
    assert scorer_from_spec(f"wordlist:{words}").score(TEXTS) == [0.0, 2 / 6, 0.0]
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(EvalInputError, match="empty.txt: the word list is empty"):
        scorer_from_spec(f"wordlist:{tmp_path / 'empty.txt'}")


def _command(code: str) -> str:
    return shlex.join([sys.executable, "-c", code])


def test_command_scorer_reads_json_lines_and_writes_a_score_a_line():
    code = "import sys, json\nfor l in sys.stdin: print(len(json.loads(l)['text']) / 100)"
    scorer = scorer_from_spec("command:" + _command(code))
    assert isinstance(scorer, CommandScorer)
    assert scorer.score(TEXTS) == [len(t) / 100 for t in TEXTS]


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("print(0.5)", "expected 3 scores, got 1"),
        ("import sys\nfor l in sys.stdin: print(2)", "score 0 is 2.0, outside \\[0, 1\\]"),
        ("import sys\nsys.exit('no model here')", "exit status 1: no model here"),
        ("import sys\nfor l in sys.stdin: print('high')", "a line of its output is no number"),
    ],
)
def test_a_command_that_answers_wrongly_is_named(code, message):
    with pytest.raises(EvalInputError, match=f"--scorer command:.*: {message}"):
        CommandScorer(_command(code)).score(TEXTS)


@pytest.fixture
def endpoint():
    """A local scorer: the score of a text is its number of 'o's / 10."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            texts = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["texts"]
            body = json.dumps({"scores": [t.count("o") / 10 for t in texts]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/score"
    server.shutdown()


def test_http_scorer_posts_the_texts(endpoint):
    scorer = scorer_from_spec(endpoint)
    assert isinstance(scorer, HttpScorer)
    assert scorer.score(TEXTS) == [0.4, 0.1, 0.0]
    with pytest.raises(EvalInputError, match="--scorer http://127.0.0.1:1/x: no answer"):
        HttpScorer("http://127.0.0.1:1/x", timeout=5).score(TEXTS)


def test_mg_eval_toxicity_writes_scores_and_the_mean(tmp_path, capsys):
    source = tmp_path / "generated.jsonl"
    source.write_text(
        "".join(json.dumps({"prompt": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    scored, report = tmp_path / "scored.jsonl", tmp_path / "report.jsonl"
    argv = ["toxicity", "--input", str(source), "--output", str(scored), "--report", str(report)]
    assert main(argv) == 0
    records = [json.loads(line) for line in scored.read_text().splitlines()]
    assert [r["toxicity"] for r in records] == [3 / 7, 0.0, 0.0]
    assert [r["prompt"] for r in records] == ["0", "1", "2"]
    metrics = json.loads(report.read_text())["metrics"]
    assert metrics == {"mean": 1 / 7, "max": 3 / 7, "scored": 1, "texts": 3}
    assert "toxicity | mean: 0.142857 | max: 0.428571 | texts with a score above 0: 1 of 3 |" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("lines", "flags", "message"),
    [
        (['{"text": "a"}'], ["--scorer", "perspective"], "--scorer perspective: unknown; use "),
        (['{"body": "a"}'], [], "generated.jsonl:1: no string field 'text' (--key)"),
        (['{"text": "a"}', "{"], [], "generated.jsonl:2: not JSON"),
    ],
)
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, lines, flags, message):
    source = tmp_path / "generated.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert main(["toxicity", "--input", str(source), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mg-eval toxicity: error: ") and message in err[0]
