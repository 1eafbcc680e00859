"""`unimae evaluate generation --tasks` takes the local tasks and any task of lm-eval's own registry."""

import pytest


@pytest.fixture(scope="module")
def manager():
    from lm_eval.tasks import TaskManager

    return TaskManager()


def test_registry_tasks_are_accepted_and_unknown_ones_named(manager):
    from unimae.evaluation.generation import check_registry_tasks, lm_eval_name

    check_registry_tasks(["arc_challenge", "sciq", "mmlu"], manager)  # the paper's tasks, in lm-eval's registry
    with pytest.raises(ValueError, match=r"unknown generation task\(s\) \['not_a_task'\]"):
        check_registry_tasks(["sciq", "not_a_task"], manager)
    assert lm_eval_name("piqa") == "unimae_piqa" and lm_eval_name("sciq") == "sciq"
    with pytest.raises(ValueError, match="tag"):  # runs arc_easy + arc_challenge but scores nothing as ai2_arc
        check_registry_tasks(["ai2_arc"], manager)


def test_unknown_task_fails_before_the_model_loads(tmp_path):
    from unimae.evaluation.generation import evaluate_generation

    with pytest.raises(ValueError, match="not_a_task"):
        evaluate_generation("no/such-model", None, tmp_path / "out", None, tasks=["not_a_task"])
