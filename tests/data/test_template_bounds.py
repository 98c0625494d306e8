"""A chat template is input: every failure is one line naming it and the sample, and its
work is bounded in steps, sizes and time (counted, never timed by the test)."""

import random

import jinja2
import pytest

from tfllm.data import DataError
from tfllm.data import template_bounds as bounds
from tfllm.data.chat import Record, SampleEncoder
from tfllm.data.chat_template import ChatTemplate
from tfllm.data.tokenizer import ByteTokenizer

CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
GOOD = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def refusal(source):
    """The one line a template's failure gives, through the sample encoder (as training
    renders it): compiling or rendering."""
    record = Record("chat.jsonl:7", "", messages=CONVERSATION)
    with pytest.raises(DataError) as e:
        SampleEncoder(ByteTokenizer(), "messages", "all",
                      ChatTemplate(source, origin="tpl.jinja"))(record)
    message = str(e.value)
    assert "\n" not in message and "tpl.jinja" in message
    return message


@pytest.mark.parametrize("source,says", [
    # Python errors of every kind, while rendering
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ range(10 ** 6) | list }}", "OverflowError"),
    ("{% include 'other.jinja' %}", "TypeError"),
    # work and sizes
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "steps"),
    ("{% for i in range(100000) %}{% for j in range(100000) if false %}{% endfor %}"
     "{% endfor %}", "steps"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
     "{{ f(60) }}", "steps"),
    ("{% for i in range(100000) %}{{ range(100000) | select('odd') | list | length }}"
     "{% endfor %}", "steps"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "rendered text"),
    ("{{ 10 ** (10 ** 9) }}", "digits"),
    ("{% set n = 10 %}{{ n ** (n ** 9) }}", "digits"),
    ("{{ 'a' * 10 ** 9 }}", "bound"),
    ("{{ 'x' | center(10 ** 9) }}", "a size of"),
    ("{{ 'x'.ljust(10 ** 9) }}", "a size of"),
    ("{{ '%999999999s' % 1 }}", "format width"),
    ("{{ '{:>999999999}'.format(1) }}", "format width"),
    ("{{ '%999999999s' | format(1) }}", "format width"),
    ("{{ ('a' * 1000).replace('a', 'a' * 100000) }}", "characters"),
    ("{% macro d(s, n) %}{{ d(s ~ s, n - 1) if n else s | length }}{% endmacro %}"
     "{{ d('x', 40) }}", "bound"),
    # doubling without a loop: each statement of the source doubles the text
    ("{% set s = 'x' * 1000 %}" + "{% set s = s ~ s %}" * 40 + "{{ s | length }}",
     "more than 4,000,000 characters"),
    ("{% set s = 'x' * 1000 %}" + "{% set s %}{{ s }}{{ s }}{% endset %}" * 40
     + "{{ s | length }}", "more than 4,000,000 characters"),
    ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(40) %}"
     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
     "more than 4,000,000 characters"),
    # work whose result is a product of sizes, judged before the work
    ("{{ range(100000) | join('x' * 4000000) }}", "may hold more than"),
    ("{{ range(100000) | map('string') | join('x' * 1000000) }}", "may hold more than"),
    ("{{ ('x' * 1000000).join(range(100000) | map('string')) }}", "may hold more than"),
    ("{{ ('a\n' * 100000) | indent(1000) }}", "may hold more than"),
    ("{{ ('\t' * 1000000).expandtabs(100) }}", "may hold more than"),
    ("{{ lipsum(n=1000000) }}", "lipsum: at most 1,000 paragraphs"),
    # a list of one long string repeated: printed or joined it is that long
    ("{% set s = 'x' * 1000000 %}{{ ([s] * 1000) | join | length }}",
     "more than 4,000,000 characters"),
])
def test_every_render_failure_is_one_line_naming_template_and_sample(source, says,
                                                                      monkeypatch):
    if says == "steps":  # a smaller bound on steps refuses them sooner (the quick tier)
        monkeypatch.setattr(bounds, "MAX_TEMPLATE_STEPS", 50_000)
    message = refusal(source)
    assert "chat.jsonl:7" in message and says in message, message


@pytest.mark.parametrize("source", [
    "{{ 10 ** (10 ** 9) }}", "{{ 'a' * 10 ** 9 }}", "{{ 'x' | center(10 ** 9) }}",
    "{{ (" * 5000 + "1" + ")" * 5000 + " }}"])
def test_compiling_folds_no_unbounded_constant(source):
    # These would take hours or all memory if jinja folded them while compiling: the
    # template compiles at once (or is refused in one line) and the render is refused.
    try:
        template = ChatTemplate(source, origin="tpl.jinja")
    except DataError as e:
        assert "tpl.jinja" in str(e) and "\n" not in str(e)
        return
    with pytest.raises(jinja2.exceptions.TemplateError):
        template.render(CONVERSATION)


def test_steps_are_counted_per_loop_iteration(monkeypatch):
    # A loop with an empty body is counted: 20 iterations fit 64 steps, 100 do not.
    monkeypatch.setattr(bounds, "MAX_TEMPLATE_STEPS", 64)
    ChatTemplate("{% for i in range(20) %}{% endfor %}").render(CONVERSATION)
    with pytest.raises(bounds.TemplateLimit, match="more than 64 steps"):
        ChatTemplate("{% for i in range(100) %}{% endfor %}").render(CONVERSATION)


def test_the_time_bound_reads_the_clock_as_steps_are_counted(monkeypatch):
    # A fake clock that advances a second per reading: a render past the bound in clock
    # readings is refused, whatever the machine's speed.
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]
    monkeypatch.setattr(bounds, "CLOCK", clock)
    monkeypatch.setattr(bounds, "MAX_TEMPLATE_SECONDS", 3.0)
    with pytest.raises(bounds.TemplateLimit, match="more than 3 s"):
        ChatTemplate("{% for i in range(50000) %}{% endfor %}").render(CONVERSATION)
    assert ChatTemplate(GOOD).render(CONVERSATION) == \
        "<user>hi</user><assistant>yo</assistant>"


def test_random_templates_fail_in_one_line_or_render():
    """Fuzz: pieces of templates joined at random (truncated tags, type swaps, huge
    numbers, deep nesting) either render or fail as one TemplateError / DataError."""
    pieces = ["{{", "}}", "{%", "%}", "for x in", "range(", ")", "10 **", "9 ** 9",
              "'a' *", "messages", "[0]", ".content", "|length", "|center(", "endfor",
              "if", "endif", "macro f()", "endmacro", "f()", "1 / 0", "(", "[", "]",
              "\ud800", "\x00", "namespace(", "loop.cycle(", "~", "'%9999999999d' %",
              "None", "-", "%}{% endfor %}", "{{ messages }}", "raise_exception('no')"]
    rng = random.Random(48)
    for _ in range(300):
        source = " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        try:
            ChatTemplate(source, origin="fuzz.jinja").render(CONVERSATION)
        except DataError as e:
            assert "\n" not in str(e) and "fuzz.jinja" in str(e)
        except jinja2.exceptions.TemplateError as e:
            assert "\n" not in str(e), source


def test_a_good_template_renders_unchanged():
    assert ChatTemplate(GOOD).render(CONVERSATION[:1], add_generation_prompt=True) == \
        "<user>hi</user><assistant>"
