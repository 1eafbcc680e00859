"""lm-eval's winogrande partial evaluation (0.4.x): two contexts, one shared continuation."""


def doc_to_text(doc):
    return {"1": 0, "2": 1}[str(doc["answer"])]


def doc_to_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def doc_to_choice(doc):
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + option for option in (doc["option1"], doc["option2"])]
