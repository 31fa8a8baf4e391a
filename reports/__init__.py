"""Results files, plots, console tables, the HTML report and the regression gate."""
