"""Training: the LightningModule (module), its optimizers and learning-rate schedules (optim, muon),
`train(run)` (run) and its steps (settings, start, setup, summary), uptraining, and stopping on
signals (interrupt). The only layer of the model's path that imports Lightning, though scoring a
batch (scoring) and distillation's term and checks (distill) load without it; import its modules
directly."""
