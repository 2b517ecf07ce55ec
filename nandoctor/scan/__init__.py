"""Static checks before training: the data a loader yields and the parameters a model starts with."""
