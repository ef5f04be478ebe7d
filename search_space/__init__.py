"""Problems (op signature, reference, inputs, tolerances, roofline counts) and variant spaces.

Everything here imports only torch: the sandbox judge loads problems on GPU hosts that hold
nothing but torch and triton.
"""

from search_space.problem import Problem, Shape, Tolerance, get_problem, problem_names

__all__ = ["Problem", "Shape", "Tolerance", "get_problem", "problem_names"]
