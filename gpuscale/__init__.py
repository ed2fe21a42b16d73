"""gpuscale: launch, watch and remember multi-GPU LLM recipes from the terminal."""

__version__ = "0.1.0"
