"""Learn causal self-attention by doing it: check questions and graded exercises.

    questions(seed=0, n=None)                  # the question bank (JSON-serializable dicts)
    exercises.write("attention", "a.py")       # a scaffold to fill in (NumPy or torch)
    grade.check("a.py")                        # graded stage by stage with causalattn.diagnose
    train_induction("induction-model")         # a model trained here: heads to inspect

The ``causalattn learn`` command is the terminal front end of all three.
"""

from . import exercises, grade
from .induction import train_induction
from .questions import KINDS, questions

__all__ = ["questions", "KINDS", "exercises", "grade", "train_induction"]
