"""How large trees should be: ``BudgetPolicy`` (``policy``) chooses each step's node
budget per request from the ``planner``'s cost model, the ``acceptance`` tables
(started from ``priors``) and ``sequoia`` shapes."""
