"""The task files: JSONL records of a task's fields (``setdiff-tasks`` writes them), read and
checked once for every task that scores records (:class:`RecordTask`), before any model is
loaded."""

from __future__ import annotations

import json

from setdiff_dist.eval.tasks import EvalError, Task, task_of
from setdiff_dist.eval.tasks.flags import DATA, LIMIT


class RecordTask(Task):
    """A task that scores the records of a ``--data`` file: it names their fields and how to
    make the file, and checks each record beyond its fields."""

    fields: tuple[str, ...] = ()
    make: str = ""  # how to make its file, said in every refusal of one
    flags = (DATA, LIMIT)

    @classmethod
    def check_record(cls, rec: dict, where: str) -> None:
        """Refuse a record whose fields are there but not of the task's form."""

    def check(self) -> None:
        args = self.args
        if not args.data:
            raise EvalError(f"--task {self.name} needs --data FILE.jsonl ({self.make})")
        check_task_file(args.data, self.name, args.limit)

    def records(self) -> list[dict]:
        return _records(self.args.data, self.args.limit, self.name)


def _records(path: str, limit: int, task: str) -> list[dict]:
    """The first ``limit`` records of the JSONL file of ``task`` (a name), each checked for the
    task's fields."""
    kind = task_of(task)
    fields, make = kind.fields, kind.make
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if len(out) == limit:
                    break
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise EvalError(f"{path}, line {number}: not JSON ({exc.msg}); a task "
                                    f"file has one JSON object per line ({make})") from None
                missing = [f for f in fields if not isinstance(rec, dict) or f not in rec]
                if missing:
                    article = "an" if task[0] in "aeiou" else "a"
                    raise EvalError(f"{path}, line {number}: no {', '.join(map(repr, missing))} "
                                    f"field: not {article} {task} task file? ({make})")
                kind.check_record(rec, f"{path}, line {number}")
                out.append(rec)
    except FileNotFoundError:
        raise EvalError(f"--data {path}: no such file ({make})") from None
    except UnicodeDecodeError as exc:
        raise EvalError(f"{path}: byte {exc.start} is not UTF-8: not a task file") from None
    if not out:
        raise EvalError(f"{path} has no records ({make})")
    return out


def check_task_file(path: str, task: str, limit: int) -> None:
    """Refuse a task file that is missing, not JSONL, or of another task, before any model
    is loaded."""
    _records(path, limit, task)


def nothing_evaluated(path: str, skipped: int, decoder) -> EvalError:
    return EvalError(f"all {skipped} records of {path} were skipped: each is longer than the "
                     f"model's context of {decoder.context} tokens; give shorter records")
