"""fivecut: train transformer LMs by cutting the job five ways."""
