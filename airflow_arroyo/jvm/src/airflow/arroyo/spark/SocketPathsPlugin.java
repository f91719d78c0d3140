/*
 * airflow-arroyo: SocketPaths' schedule in an executor's JVM.
 */
package airflow.arroyo.spark;

import com.codahale.metrics.Gauge;
import java.util.Map;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.spark.api.plugin.DriverPlugin;
import org.apache.spark.api.plugin.ExecutorPlugin;
import org.apache.spark.api.plugin.PluginContext;
import org.apache.spark.api.plugin.SparkPlugin;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * A Spark plugin ({@code spark.plugins}) whose executor component runs {@link SocketPaths#forgetDeleted} every
 * {@value #INTERVAL_CONF} (default {@value #DEFAULT_INTERVAL}) in each executor's JVM: with Python workers over
 * Unix domain sockets an executor registers a socket file with {@code File.deleteOnExit()} for each Python
 * {@code transformWithState} task (its state server's socket), each barrier task and each Python worker it
 * starts, and deletes the file itself when done; the JDK would keep every path until the executor exits. The
 * driver's JVM is pruned by the pipeline's driver loop ({@code airflow_arroyo.jvm.SocketPathPruner}), so the
 * plugin has no driver component: the provider configures it where executors are JVMs of their own (standalone
 * masters), not on a local master, whose one JVM the driver loop already prunes.
 *
 * <p>It reports two gauges in the executor's metrics ({@code plugin.airflow.arroyo.spark.SocketPathsPlugin.*}):
 * {@code registered}, the paths the JVM's list holds at the last prune, and {@code forgotten}, the paths dropped
 * since the executor started. A Java error from {@link SocketPaths} (e.g. {@code java.io} not opened to the class
 * path; Spark's launcher opens it) stops the schedule with one log line, and an interval of 0 or less, or a
 * setting that does not parse, turns it off (logged): the executor runs on without it.
 */
public final class SocketPathsPlugin implements SparkPlugin {
  /** How often an executor prunes, a Spark time string. */
  public static final String INTERVAL_CONF = "spark.airflow.arroyo.socketPaths.interval";
  /** The newest paths a prune leaves (a path is registered just before its socket is bound). */
  public static final String KEEP_NEWEST_CONF = "spark.airflow.arroyo.socketPaths.keepNewest";

  static final String DEFAULT_INTERVAL = "10s";
  static final int DEFAULT_KEEP_NEWEST = 16;

  @Override
  public DriverPlugin driverPlugin() {
    return null;
  }

  @Override
  public ExecutorPlugin executorPlugin() {
    return new Pruner();
  }

  /** The executor's component: one daemon thread. */
  static final class Pruner implements ExecutorPlugin {
    private static final Logger LOG = LoggerFactory.getLogger(SocketPathsPlugin.class);
    private final AtomicLong registered = new AtomicLong(-1);
    private final AtomicLong forgotten = new AtomicLong();
    private ScheduledExecutorService schedule;
    private int keepNewest;

    @Override
    public void init(PluginContext ctx, Map<String, String> extraConf) {
      // a bad setting must not stop the executor (Spark does not catch a plugin's init): log it, do not prune
      long intervalMs;
      try {
        intervalMs = ctx.conf().getTimeAsMs(INTERVAL_CONF, DEFAULT_INTERVAL);
        keepNewest = Math.max(0, ctx.conf().getInt(KEEP_NEWEST_CONF, DEFAULT_KEEP_NEWEST));
      } catch (RuntimeException e) {
        LOG.warn("{} or {} is not valid; not pruning the delete-on-exit list", INTERVAL_CONF, KEEP_NEWEST_CONF, e);
        return;
      }
      if (intervalMs <= 0) {
        LOG.info("{} is {} ms: not pruning the delete-on-exit list", INTERVAL_CONF, intervalMs);
        return;
      }
      ctx.metricRegistry().register("registered", (Gauge<Long>) registered::get);
      ctx.metricRegistry().register("forgotten", (Gauge<Long>) forgotten::get);
      schedule = Executors.newSingleThreadScheduledExecutor(task -> {
        Thread thread = new Thread(task, "arroyo-socket-paths");
        thread.setDaemon(true);
        return thread;
      });
      schedule.scheduleWithFixedDelay(this::prune, intervalMs, intervalMs, TimeUnit.MILLISECONDS);
      LOG.info("pruning the delete-on-exit list every {} ms, keeping the newest {} paths", intervalMs, keepNewest);
    }

    private void prune() {
      try {
        forgotten.addAndGet(SocketPaths.forgetDeleted(keepNewest));
        registered.set(SocketPaths.registered());
      } catch (Throwable e) { // any: the scheduler would swallow it and stop without a word
        LOG.warn("cannot prune the JVM's delete-on-exit list, not trying again", e);
        schedule.shutdown();
      }
    }

    @Override
    public void shutdown() {
      if (schedule != null) {
        schedule.shutdownNow();
      }
    }
  }
}
