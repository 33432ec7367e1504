"""maingrad.analyzer: a libcst static analyzer for the main_grad contract (rules MG001...)."""

__version__ = "0.1.0"
