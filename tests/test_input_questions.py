"""Codex's request_user_input questions: shown numbered with a fitting hint, answered by an
option's number, its label or free text; a question for a secret is never asked (issue 11).
The chat thread's side is proven through a real `bothy serve` in tests/test_chat_questions.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bothy.engine.questions import InputQuestion
from bothy.engine.rpc import ServerRequest
from bothy.engine.state import StateDB
from bothy.engine.toolbox import NO_SECRET
from tests.test_verdicts import Clock, RecordingConnection, clock, db, profile, toolbox

__all__ = ["clock", "db"]  # fixtures used here, defined in test_verdicts

DOOR = InputQuestion.of({
    "id": "colour", "header": "Colour", "question": "Which colour should the bothy door be?",
    "isOther": True, "isSecret": False,
    "options": [{"label": "Green (Recommended)", "description": "traditional"},
                {"label": "Red", "description": ""}, {"label": "", "description": "no label"}]})


def test_options_are_numbered_and_the_hint_says_how_to_answer() -> None:
    """Each labelled option on its own numbered line; the hint names the numbers."""
    assert DOOR.shown() == ("Which colour should the bothy door be?\n"
                            "1. Green (Recommended) — traditional\n"
                            "2. Red")
    assert DOOR.hint() == "Answer with a number (1–2), an option's name, or your own words."


@pytest.mark.parametrize(("reply", "answer"), [
    ("1", "Green (Recommended)"),
    (" 2 ", "Red"),
    ("red", "Red"),
    ("green  (recommended)", "Green (Recommended)"),
    ("3", "3"),
    ("0", "0"),
    ("Blue, like the loch", "Blue, like the loch"),
])
def test_an_answer_is_a_number_a_label_or_free_text(reply: str, answer: str) -> None:
    """A number in range or a label (any case) becomes the option's label; else as written."""
    assert DOOR.answer(reply) == answer


def test_a_question_without_options_asks_for_words() -> None:
    """No options: nothing numbered, and the hint asks for an answer in words."""
    plain = InputQuestion.of({"id": "why", "header": "Why", "question": "Why?"})
    assert (plain.shown(), plain.hint(), plain.answer("1")) == (
        "Why?", "Answer in your own words.", "1")
    one = InputQuestion.of({"id": "x", "question": "Go?", "options": [{"label": "Go"}]})
    assert one.hint() == "Answer with a number (1), an option's name, or your own words."


async def test_a_question_for_a_secret_is_declined_without_asking(
    tmp_path: Path, db: StateDB, clock: Clock
) -> None:
    """isSecret: nobody is asked (a reply would stay in the thread and the register); the
    model is told so, and the register says why."""
    box, audit = toolbox(tmp_path, db, clock, profile(tools=[], question_hold_seconds=30))
    connection = RecordingConnection()
    request = ServerRequest(5, "item/tool/requestUserInput", {"questions": [
        {"id": "key", "header": "Key", "question": "What is the deploy key?", "isSecret": True}]})

    await box.handle(request, connection)

    assert connection.results[5] == {"answers": {"key": {"answers": [NO_SECRET]}}}
    [record] = [r for r in audit.records() if r.kind == "question"]
    assert (record.event, record.details["question"]) == ("declined", "What is the deploy key?")
    assert "secret" in record.details["reason"]
    assert [r for r in audit.records() if (r.kind, r.event) == ("run", "question")] == []
