/*
 * airflow-arroyo: Spark's streaming checkpoint files written straight to their final name on an object store whose
 * output streams can be aborted (S3A: fs.capability.outputstream.abortable), instead of a temporary file renamed.
 *
 * Spark's default checkpoint file manager (FileContextBasedCheckpointFileManager) writes every checkpoint file
 * (offsets/b, commits/b, state store files) to a temporary file and renames it; on S3A a rename is a copy and a
 * delete: three requests more per file, and a file left behind by a crash between them. On S3 an object appears
 * whole or not at all when its upload completes, so writing the final name directly is atomic: this manager
 * creates the final path and either completes the upload (close) or aborts it (cancel: nothing appears).
 *
 * spark-hadoop-cloud's AbortableStreamBasedCheckpointFileManager does the same, but that module is not published
 * for every Spark release (none for 4.2.0 on Maven Central), and it logs and swallows an error raised when the
 * upload completes at close: the caller would believe a file written that is not. Here close() propagates it.
 * Spark's warning stands: never let two running queries share a checkpoint folder (the driver never does: a
 * restore or a takeover writes a new folder). airflow_arroyo.runtime.spark_checkpoint chooses it for a stage
 * whose checkpoint is on S3.
 */
package airflow.arroyo.spark;

import java.io.IOException;
import java.nio.file.FileAlreadyExistsException;
import java.util.EnumSet;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.CreateFlag;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileContext;
import org.apache.hadoop.fs.Options;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.UnsupportedFileSystemException;
import org.apache.spark.sql.execution.streaming.checkpointing.AbstractFileContextBasedCheckpointFileManager;
import org.apache.spark.sql.execution.streaming.checkpointing.CheckpointFileManager;

public class AbortableCheckpointFileManager extends AbstractFileContextBasedCheckpointFileManager {
  /** Hadoop's path capability of a file system whose output streams can be aborted. */
  public static final String ABORTABLE = "fs.capability.outputstream.abortable";

  public AbortableCheckpointFileManager(Path path, Configuration hadoopConf) throws IOException {
    super(path, hadoopConf);
    if (!fc().hasPathCapability(path, ABORTABLE)) {
      throw new UnsupportedFileSystemException(
          "AbortableCheckpointFileManager needs a file system whose output streams can be aborted (" + ABORTABLE
              + "), such as S3A; " + path + " is not on one");
    }
  }

  @Override
  public CheckpointFileManager.CancellableFSDataOutputStream createAtomic(Path path, boolean overwriteIfPossible) {
    EnumSet<CreateFlag> flags =
        overwriteIfPossible ? EnumSet.of(CreateFlag.CREATE, CreateFlag.OVERWRITE) : EnumSet.of(CreateFlag.CREATE);
    try {
      // createParent: no request asking whether the parent folder exists (S3 has no folders to create)
      return new Stream(fc().create(path, flags, Options.CreateOpts.createParent()), fc(), path, overwriteIfPossible);
    } catch (IOException e) {
      throw new java.io.UncheckedIOException("cannot create checkpoint file " + path, e);
    }
  }

  /** The final path's upload: completed by close(), aborted by cancel(); whichever comes first is the only one. */
  private static final class Stream extends CheckpointFileManager.CancellableFSDataOutputStream {
    private final FSDataOutputStream out;
    private final FileContext fc;
    private final Path path;
    private final boolean overwrite;
    private boolean done;

    Stream(FSDataOutputStream out, FileContext fc, Path path, boolean overwrite) {
      super(out);
      this.out = out;
      this.fc = fc;
      this.path = path;
      this.overwrite = overwrite;
    }

    @Override
    public synchronized void cancel() {
      if (done) {
        return;
      }
      done = true;
      try {
        out.abort();
        out.close();
      } catch (IOException | RuntimeException e) {
        // the upload was aborted or never completes: nothing appears at the path either way
      }
    }

    @Override
    public synchronized void close() throws IOException {
      if (done) {
        return;
      }
      if (!overwrite && fc.util().exists(path)) {
        cancel();
        throw new FileAlreadyExistsException(path + " exists: not overwritten (another writer of this checkpoint?)");
      }
      done = true;
      out.close();
    }

    @Override
    public String toString() {
      return "AbortableCheckpointFileManager.Stream(" + path + ")";
    }
  }
}
