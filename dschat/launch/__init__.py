"""How ``train.py`` starts the steps: the step registry and each step's command line (:mod:`.steps`),
presets (:mod:`.presets`), the launcher command of a deployment (:mod:`.launcher`) and the supervision
of a step's ranks (:mod:`.supervise`). ``train.py`` keeps the command line, the memory plan's glue and
the order of the steps."""
