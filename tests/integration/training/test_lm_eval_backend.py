"""tools/evaluate.py --tasks with a name neither the task directory nor the harness knows: the name
is looked up in the harness's whole index (about 12,000 task files, tens of seconds of CPU), and the
one-line error also names the directory's file that does not parse. The other one-line errors of
--tasks: tests/unit/training/test_lm_eval_backend.py."""

from __future__ import annotations

from tests.unit.training.test_lm_eval_backend import broken_task_dir, one_line_error, tiny_model
from tools import evaluate as evaluate_tool
from training.model_io import ModelSource, write_export


def test_a_name_no_index_knows_is_one_line_naming_the_file_that_does_not_parse(tmp_path, capsys):
    model = tiny_model()
    exported = write_export(ModelSource(model.cfg, model.state_dict(), "byte", 0, "test"), tmp_path / "st",
                            "safetensors")
    broken = broken_task_dir(tmp_path)
    one_line_error(capsys, evaluate_tool.main([str(exported), "--tasks", "broken", "--task-dir", str(broken)]),
                   "unknown harness task 'broken'", "broken.yaml does not parse", "line 2")
