"""``inference/chat.py`` as a person uses it: in a pseudo-terminal, with --prompt, and reading stdin.

The models answer in known ways (tests/tiny_chat_models.py): ``right`` says " 579" and stops, ``turns``
says " 0123456789" and then invents a "\\nHuman:" turn, ``endless`` never stops on its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pexpect
import pytest

from dschat.utils.errors import UserError
from tests.conftest import ROOT, run_cmd
from tests.e2e.conftest import ENDLESS, load_entry_main
from tests.integration.helpers import assert_ok, error_line

CHAT = str(ROOT / "inference" / "chat.py")
PROMPT = "Human: "
FORGOT = "oldest message(s) no longer fit"


def spawn(*args: str) -> pexpect.spawn:
    """chat.py on a terminal. It starts with Ctrl-C ignored, as under a shell that ran the test suite in
    the background (`cmd &` without job control ignores SIGINT in every descendant): the tool itself must
    make Ctrl-C stop a reply."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return pexpect.spawn(sys.executable, [CHAT, *map(str, args)], env=env, cwd=str(ROOT), encoding="utf-8",
                         timeout=90, dimensions=(40, 400),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip


def ctrl_c_at_the_prompt(child: pexpect.spawn) -> None:
    """Ctrl-C at the prompt gives a hint and a new prompt, not an exit.

    CPython's readline draws the prompt and only then waits in select(); a SIGINT that lands between the
    two sets Python's flag but interrupts no wait, so it surfaces only with the next key (any REPL does
    this; a person presses Ctrl-C again). One CI run on a loaded machine hit that window, so a second
    Ctrl-C is sent when the first showed nothing for a while: the hint must come then, and the process must
    never exit."""
    child.sendintr()
    if child.expect(["Ctrl-D to leave", pexpect.TIMEOUT, pexpect.EOF], timeout=10) == 0:
        return
    assert child.isalive(), "Ctrl-C at the prompt ended chat.py"
    child.sendintr()
    child.expect("Ctrl-D to leave")


def test_two_turns_with_history_clear_and_quit(tiny):
    # The model's context is 1024 tokens; 994 reserved for the reply leaves 30 for the prompt: one
    # "hi" turn (24 tokens) fits, "hi" + reply + "hi" (51) does not, so the second turn must forget
    # the first, which shows that the history is in the prompt; after `clear` nothing is forgotten.
    child = spawn("--path", tiny.right, "--greedy", "--max_new_tokens", 994)
    child.expect(PROMPT)
    child.sendline("hi")
    child.expect("Assistant: 579\r\n")
    child.expect(PROMPT)
    assert FORGOT not in child.before
    child.sendline("hi")
    child.expect("the 2 oldest message\\(s\\) no longer fit")
    child.expect("Assistant: 579\r\n")
    child.expect(PROMPT)
    child.sendline("clear")
    child.expect("conversation cleared")
    child.expect(PROMPT)
    child.sendline("hi")
    child.expect("Assistant: 579\r\n")
    child.expect(PROMPT)
    assert FORGOT not in child.before
    child.sendline("quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_streaming_ctrl_c_stops_the_reply_and_ctrl_d_leaves(tiny):
    # The reply would run to 60000 tokens (minutes). Its first characters are on the screen long before
    # that, and Ctrl-C then ends it: without streaming nothing would show before pexpect's timeout, and
    # the Ctrl-C would land at the next prompt instead of stopping the reply. No bound on how many
    # characters come out before the stop: that is the machine's speed, not the behaviour under test.
    budget = 60000
    child = spawn("--path", tiny.endless, "--greedy", "--max_new_tokens", budget)
    child.expect(PROMPT)
    child.sendline("   ")  # an empty message: asked again, nothing generated
    child.expect(PROMPT)
    assert "Assistant" not in child.before
    child.sendline("go")
    child.expect("Assistant: 0123")
    child.sendintr()  # Ctrl-C while the reply is being written
    child.expect(r" \[stopped\]")
    partial = ("0123" + child.before).replace("^C", "", 1)  # the terminal echoes the Ctrl-C
    cycle = ENDLESS.strip() + ": "  # after "Assistant: " the chain goes on "0..z: 0..z: ..."
    assert (cycle * (len(partial) // len(cycle) + 2)).startswith(partial)  # the reply so far, in order
    assert len(partial) < budget and "Ctrl-D to leave" not in partial
    child.expect(PROMPT)
    ctrl_c_at_the_prompt(child)
    child.expect(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and child.signalstatus is None


def test_prompt_answers_once_and_cuts_the_invented_turn(tiny):
    proc = run_cmd(
        [CHAT, "--path", str(tiny.turns), "--prompt", "hello", "--greedy", "--max_new_tokens", "40"]
    )
    assert_ok(proc)
    # the model goes on with "\nHuman: 0123456789..."; the reply ends where that turn starts
    assert proc.stdout == "0123456789\n"


def test_stdin_messages_and_commands(tiny):
    proc = subprocess.run(
        [sys.executable, CHAT, "--path", str(tiny.right), "--greedy"],
        input="hello\n\nclear\nWhat is 500 + 79?\nquit\nnever read\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert_ok(proc)
    assert proc.stdout.splitlines() == ["579", "579"]
    assert "(conversation cleared)" in proc.stderr


def test_a_reader_that_goes_away_ends_chat_quietly(tiny):
    """`chat.py < messages | head -1`: when the pipe closes, chat.py stops at once with status 0 and no
    traceback (it aborted with a BrokenPipeError while its generation thread ran)."""
    proc = subprocess.Popen([sys.executable, CHAT, "--path", str(tiny.right), "--greedy"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    proc.stdin.write("hi\n" * 200)
    proc.stdin.close()
    assert proc.stdout.readline() == "579\n"
    proc.stdout.close()  # the reader goes away
    assert proc.wait(timeout=120) == 0
    err = proc.stderr.read()
    assert "Traceback" not in err and "BrokenPipe" not in err and "terminate called" not in err


def test_ctrl_c_stops_a_run_reading_messages_from_a_pipe(tiny):
    """Piped messages: Ctrl-C (SIGINT) stops the reply in progress and the run, not one reply per line."""
    proc = subprocess.Popen([sys.executable, CHAT, "--path", str(tiny.endless), "--greedy", "--max_new_tokens",
                             "60000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    proc.stdin.write("one\ntwo\nthree\n")
    proc.stdin.close()
    assert proc.stdout.read(5)  # the first reply is streaming
    proc.send_signal(signal.SIGINT)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 130  # stopped by the user, as a shell reports it
    assert out.endswith(" [stopped]\n") and out.count("\n") == 1  # no second reply


def test_lora_adapter_without_its_base_is_one_line(tiny):
    line = error_line(run_cmd([CHAT, "--path", str(tiny.adapter), "--prompt", "hi"]))
    assert "deleted-base" in line and "pass --base_model" in line


# The remaining cases call the entry's main() in this process (the one-line contract around a UserError
# is run_cli's, shown by the subprocess test above): no interpreter start-up per case.
@pytest.fixture(scope="module")
def chat_main():
    return load_entry_main(CHAT, "dschat_chat_cli")


def test_lora_adapter_with_base_model(tiny, chat_main, capsys):
    assert (
        chat_main(
            ["--path", str(tiny.adapter), "--base_model", str(tiny.right), "--prompt", "hi", "--greedy"]
        )
        == 0
    )
    assert (
        capsys.readouterr().out == "579\n"
    )  # the adapter changes q/v projections, whose output this model ignores


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--path", "{root}/no-such-model"], "--path .*no-such-model: no such local file or directory"),
        (["--path", "{root}"], "no config.json, not a model directory .*model directories inside: .*right"),
        (["--path", "{reward}"], "is a reward model"),
        (["--path", "{right}", "--max_new_tokens", "1024"], r"--max_new_tokens 1024: .* context \(1024\)"),
        (["--path", "{right}", "--temperature", "0"], "--temperature 0.0: must be > 0"),
    ],
    ids=["missing", "step-dir", "reward-model", "no-room", "temperature"],
)
def test_bad_input(tiny, chat_main, args, message):
    args = [a.format(root=tiny.root, reward=tiny.reward, right=tiny.right) for a in args]
    with pytest.raises(UserError, match=message):
        chat_main([*args, "--prompt", "hi"])


def test_empty_prompt(tiny, chat_main, capsys):
    with pytest.raises(SystemExit) as exc:
        chat_main(["--path", str(tiny.right), "--prompt", "  "])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "error: --prompt: the message is empty (see chat.py --help)\n"


def test_base_model_with_a_whole_model_is_one_line(tiny, chat_main):
    # --base_model was ignored when --path is not an adapter: another model than the user meant answered
    with pytest.raises(UserError, match=r"--base_model .*wrong: --path .*right is a whole model, not a LoRA"):
        chat_main(["--path", str(tiny.right), "--base_model", str(tiny.wrong), "--prompt", "hi"])


def test_a_missing_chat_template_is_refused_before_the_weights_load(tiny, chat_main, monkeypatch):
    import dschat.models.loading as loading

    def no_weights(*a, **k):
        raise AssertionError("the weights loaded before the flags were checked")

    monkeypatch.setattr(loading, "load_causal_lm", no_weights)
    with pytest.raises(UserError, match=r"--chat_template on: .* has no chat template"):
        chat_main(["--path", str(tiny.right), "--chat_template", "on", "--prompt", "hi"])
    with pytest.raises(UserError, match=r"--max_new_tokens 1024: .* context \(1024\)"):
        chat_main(["--path", str(tiny.right), "--max_new_tokens", "1024", "--prompt", "hi"])


def test_a_reply_cut_at_max_new_tokens_says_so(tiny, chat_main, capsys):
    # a reply that ran out of --max_new_tokens printed as if the model had finished it
    assert (
        chat_main(["--path", str(tiny.endless), "--prompt", "hi", "--greedy", "--max_new_tokens", "5"]) == 0
    )
    assert capsys.readouterr().out == f"{ENDLESS[:5].strip()} [cut off at --max_new_tokens 5]\n"
    assert chat_main(["--path", str(tiny.right), "--prompt", "hi", "--greedy", "--max_new_tokens", "5"]) == 0
    assert capsys.readouterr().out == "579\n"  # ended by the model within the budget


def test_a_message_that_is_not_utf8_is_one_note_and_the_chat_goes_on(tiny):
    """Bytes that are not UTF-8 on stdin (or typed) ended chat.py with a traceback from the tokenizer; the
    message is now left out with one note, and the next one is answered."""
    proc = subprocess.run([sys.executable, CHAT, "--path", str(tiny.right), "--greedy"],
                          input=b"hi \xff\xfe there\nWhat is 500 + 79?\n", capture_output=True, timeout=120,
                          cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.decode().splitlines() == ["579"]
    assert b"not valid UTF-8" in proc.stderr


def test_the_prompt_flag_is_refused_when_not_utf8_and_sent_stripped(tiny, chat_main, capsys, monkeypatch):
    """--prompt "$(cat file)" keeps the file's newline: the message is stripped as a typed one is (its token
    ids then match training's); a --prompt of undecodable bytes (surrogate escapes) is one line."""
    with pytest.raises(SystemExit) as exc:
        chat_main(["--path", str(tiny.right), "--prompt", "hi \udcff there"])
    assert exc.value.code == 2 and "--prompt: not valid UTF-8 text" in capsys.readouterr().err
    sent = []
    monkeypatch.setattr(sys.modules["dschat_chat_cli"].Chat, "say", lambda self, m, label="": sent.append(m))
    assert chat_main(["--path", str(tiny.right), "--prompt", "What is 500 + 79?\n "]) == 0
    assert sent == ["What is 500 + 79?"]
