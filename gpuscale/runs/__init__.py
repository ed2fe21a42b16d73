"""The control plane: launching, supervising and recording runs on the login node. Never imports torch,
transformers, textual, nor gpuscale.engines/recipes/app; a rank may use its plain types."""
