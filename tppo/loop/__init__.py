"""The training loop: the driver's step (`driver.rl_step`), a whole run with resume and summary (`run.train`),
the ReLibra adapter that plans each step from its replayed routing (`balance`), the tasks and the report."""
